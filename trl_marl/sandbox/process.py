"""Run one sandbox command under a wall deadline with capped output capture, and kill what is left afterwards.

Every started process is recorded in a module-level registry with the object that started it, so [`kill_all`] can
kill one `Sandbox`'s runs (when it is interrupted or closed) or, at exit, every run of this process.
"""

from __future__ import annotations

import atexit
import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_LIVE: dict[subprocess.Popen, tuple[object, Callable | None]] = {}  # running command -> (its owner, its stop)
_LIVE_LOCK = threading.Lock()
STOP_GRACE_S = 2.0  # how long a stopped command has to exit by itself, and its killed orphans to die


@dataclass
class Finished:
    returncode: int | None  # None when the parent killed it at the deadline
    timed_out: bool
    flooded: bool  # stdout or stderr exceeded the capture cap, so the parent killed it
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_time_s: float

    @classmethod
    def not_started(cls) -> Finished:
        return cls(None, False, False, b"", b"", False, False, 0.0)


# Dropping to another uid with setpriv (util-linux) lets Python start the command with vfork(); `Popen(user=...)` must
# fork() the trainer, which costs 10-25 ms more per run for a trainer with torch loaded (docs/sandbox.md#performance).
_SETPRIV = shutil.which("setpriv", path="/usr/bin:/bin")


def _as_user(argv: list[str], user: int | None) -> tuple[list[str], int | None]:
    """``argv`` and the ``user=`` for Popen that start it as ``user`` (uid = gid, no supplementary groups)."""
    if user is None or _SETPRIV is None:
        return argv, user
    return [_SETPRIV, f"--reuid={user}", f"--regid={user}", "--clear-groups", "--", *argv], None


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process group that the sandbox command leads (it was started in a new session)."""
    for kill in (lambda: os.killpg(process.pid, signal.SIGKILL), lambda: os.kill(process.pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def kill_all(owner: object = None) -> None:
    """Kill the running sandboxes started for ``owner``; every one this process started when ``owner`` is None."""
    # Under the lock: a command leaves the registry before it is reaped, so no signal can reach a reused pid.
    with _LIVE_LOCK:
        for process, (started, stop) in _LIVE.items():
            # A command stopped by its own `stop` exits by itself; its run_command reaps it.
            if (owner is None or started is owner) and (stop is None or not stop(process)):
                kill_group(process)


atexit.register(kill_all)


def run_command(
    argv: Sequence[str],
    *,
    stdin: bytes | None,
    wall_time_s: float,
    output_bytes: int,
    env: dict[str, str],
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
    user: int | None = None,
    owner: object = None,
    stop: Callable[[subprocess.Popen], bool] | None = None,
) -> Finished:
    """Start ``argv`` in a new session and collect its output until it exits, floods, or reaches the deadline.

    The output is drained as it comes and never awaited to EOF: a descendant may keep a pipe open after the command
    exits. Whatever happens, the command's process group is SIGKILLed and reaped before this returns. ``stop``, when
    given, is how a command that is still running is killed first (it returns whether it did); the command then exits
    by itself, having reaped its own children, within `STOP_GRACE_S` or its process group is killed.
    """
    stdin_fd = None
    if stdin is not None:  # a memory file: no writer thread, no pipe to fill
        stdin_fd = os.memfd_create("sandbox-stdin")
        os.write(stdin_fd, stdin)
        os.lseek(stdin_fd, 0, os.SEEK_SET)
    start = time.monotonic()
    deadline = start + wall_time_s
    argv, user = _as_user(list(argv), user)
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL if stdin_fd is None else stdin_fd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            pass_fds=tuple(pass_fds),
            start_new_session=True,
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
        )
    finally:
        if stdin_fd is not None:
            os.close(stdin_fd)
    with _LIVE_LOCK:
        _LIVE[process] = (owner, stop)
    captured = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    truncated = dict.fromkeys(captured, False)
    timed_out = flooded = exited = False
    selector = selectors.DefaultSelector()
    try:
        for fd in captured:
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while not exited:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            if selector.get_map():
                events = selector.select(min(remaining, 0.05))
            else:  # both pipes closed, the command may still be running
                events = []
                time.sleep(min(remaining, 0.005))
            for key, _ in events:
                flooded |= _read_into(key.fd, captured[key.fd], truncated, output_bytes, selector)
            if flooded:
                break
            exited = _exited(process.pid, timeout_s=0)
        if exited:  # take what is already buffered, without waiting for EOF
            for fd in list(selector.get_map()):
                _read_into(fd, captured[fd], truncated, output_bytes, selector)
    finally:
        # Exited or killed, the command is reaped last: until then its pid and group id cannot be reused.
        if not exited:
            _stop(process, stop)
        kill_group(process)  # what is left of its group (the local backend's children)
        _reap_orphans(process.pid)
        with _LIVE_LOCK:
            _LIVE.pop(process, None)
        _, exit_status = os.waitpid(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(exit_status)  # keeps Popen from reaping it again
        selector.close()
        process.stdout.close()
        process.stderr.close()
    stdout_fd, stderr_fd = captured
    return Finished(
        returncode=None if timed_out or flooded else process.returncode,
        timed_out=timed_out,
        flooded=flooded,
        stdout=bytes(captured[stdout_fd]),
        stderr=bytes(captured[stderr_fd]),
        stdout_truncated=truncated[stdout_fd],
        stderr_truncated=truncated[stderr_fd],
        wall_time_s=time.monotonic() - start,
    )


def _stop(process: subprocess.Popen, stop: Callable[[subprocess.Popen], bool] | None) -> None:
    """Kill a command that is still running; return once it has exited, leaving it to be reaped."""
    if stop is not None and stop(process) and _exited(process.pid, timeout_s=STOP_GRACE_S):
        return
    kill_group(process)
    _exited(process.pid, timeout_s=None)


def _exited(pid: int, timeout_s: float | None) -> bool:
    """Whether child ``pid`` has exited, waiting up to ``timeout_s`` (None: until it has), without reaping it."""
    if timeout_s is None:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        return True
    deadline = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def _reap_orphans(session: int) -> None:
    """Reap the processes of a command's session that were orphaned to this process, once they have died.

    Orphans go to the nearest subreaper, else to PID 1: to the trainer when it runs as PID 1 in a container without an
    init. Unreaped, each would stay a zombie, and zombies count against the sandbox user's process limit. Only
    processes of ``session`` (the command started its own) are reaped, never another child of the trainer. They were
    SIGKILLed with their group; one still dying is waited for up to `STOP_GRACE_S`.
    """
    deadline = time.monotonic() + STOP_GRACE_S
    while True:
        dying = False
        for pid, state in _children_in_session(session):
            if state != "Z":
                dying = True
                continue
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if not dying or time.monotonic() > deadline:
            return
        time.sleep(0.002)


def _children_in_session(session: int) -> list[tuple[int, str]]:
    """(pid, state) of this process's children that belong to ``session``, but its leader."""
    found = []
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids = children.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[3]) == session and int(pid) != session:  # fields: state, ppid, pgrp, session, ...
                found.append((int(pid), fields[0]))
    return found


def _read_into(fd: int, buffer: bytearray, truncated: dict, cap: int, selector) -> bool:
    """Read what ``fd`` has now into ``buffer``; True when the cap was exceeded."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            selector.unregister(fd)
            return False
        room = cap - len(buffer)
        buffer += chunk[: max(room, 0)]
        if len(chunk) > room:
            truncated[fd] = True
            return True
