"""Where sandboxed code runs: bubblewrap (the isolation boundary) or the explicit, weaker local mode.

Both backends start the same harness (``harness.py``) with the same rlimits; they differ in what the child can see and
reach. See docs/sandbox.md for the threat model and what each one guarantees.
"""

from __future__ import annotations

import json
import marshal
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from .cleanup import remove_tree
from .harness import JOB_FORMAT, SETUP_EXIT_CODE
from .process import Finished, run_command
from .result import Limits
from .seccomp import filter_program

HARNESS_SOURCE = (Path(__file__).with_name("harness.py")).read_bytes()
NOBODY = 65534  # the uid/gid sandboxes run as when the trainer runs as root (RLIMIT_NPROC does not bind root)
_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_ROOT_ENTRIES = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")  # merged-/usr symlinks (or directories) at /


class SandboxUnavailable(RuntimeError):
    """The requested isolation cannot be provided on this machine; nothing was run."""


def sandbox_user() -> int | None:
    """The uid sandboxes run as: ``nobody`` when this process is root, else this process's own uid (None)."""
    return NOBODY if os.geteuid() == 0 else None


def _reachable(path: str, user: int | None) -> bool:
    """Whether ``user`` (None: this process) can execute ``path``, judged by the others-bits of it and its parents."""
    if user is None:
        return os.access(path, os.X_OK)
    current = Path(path)
    for parent in current.parents:
        if not os.stat(parent).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(current).st_mode & stat.S_IXOTH)


def sandbox_python(user: int | None) -> str:
    """The interpreter that runs sandboxed code: the base interpreter of this Python if ``user`` can run it, else
    ``/usr/bin/python3``. Raises SandboxUnavailable when neither is usable."""
    candidates = [os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable), "/usr/bin/python3"]
    for candidate in candidates:
        if os.path.isfile(candidate) and _reachable(candidate, user):
            return os.path.realpath(candidate)
    who = "this user" if user is None else f"uid {user} (sandboxes run as nobody when the trainer runs as root)"
    raise SandboxUnavailable(
        f"No Python interpreter that {who} can execute: tried {', '.join(candidates)}. Install python3 system-wide "
        "(for example `apt-get install python3`) or pass `python=` to Sandbox."
    )


def _python_argv(python: str) -> list[str]:
    """How the harness is started: no user or system site-packages (``-s -S``), no bytecode written (``-B``).

    Not ``-I``/``-E``: the environment is the sandbox's own (cleared, then `_SANDBOX_ENV`), and ``-E`` would drop its
    ``PYTHONHASHSEED=0``, which makes the iteration order of sets of strings the same in every run. The harness removes
    its own directory from ``sys.path``.
    """
    return [python, "-s", "-S", "-B"]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def lifeline_pipe() -> tuple[int, int]:
    """A pipe whose write end only the trainer holds (it is not inherited): the harness reads end of file from the
    other end once the trainer has died."""
    return os.pipe()


@dataclass
class Run:
    """A backend's raw outcome: the finished command, or why the sandbox refused to start."""

    finished: Finished
    refused: str = ""


class BubblewrapBackend:
    """Runs each sample in a fresh bubblewrap sandbox.

    All namespaces are new (user, pid, network, ipc, uts, cgroup, mount) and no nested user namespace can be made;
    capabilities are dropped; the root is an empty read-only tmpfs holding only read-only ``/usr`` (and the
    interpreter's own prefix, with its site-packages hidden), a private ``/proc``, a minimal ``/dev``, and size-capped
    tmpfs mounts for ``/scratch`` (also ``/tmp`` and ``$HOME``) and ``/dev/shm``. The environment is cleared. When the
    sandbox's first process exits, or bubblewrap or the trainer dies, the kernel kills every process of its pid
    namespace.
    """

    name = "bubblewrap"

    def __init__(self, bwrap: str, python: str, user: int | None):
        self.bwrap, self.python, self.user = bwrap, python, user

    def _mounts(self, limits: Limits) -> list[str]:
        args = ["--ro-bind", "/usr", "/usr"]
        for entry in _ROOT_ENTRIES:
            host = f"/{entry}"
            if os.path.islink(host):
                args += ["--symlink", os.readlink(host), host]
            elif os.path.isdir(host):
                args += ["--ro-bind", host, host]
        prefix = Path(self.python).parent.parent
        if not self.python.startswith("/usr/"):
            args += ["--ro-bind", str(prefix), str(prefix)]
            for site_packages in sorted(prefix.glob("lib/python3*/site-packages")):
                args += ["--size", "4096", "--tmpfs", str(site_packages), "--remount-ro", str(site_packages)]
        args += ["--proc", "/proc", "--size", str(1 << 16), "--tmpfs", "/dev"]
        for device in ("null", "zero", "full", "random", "urandom"):
            args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
        args += ["--size", str(int(limits.shm_bytes)), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
        args += ["--size", str(int(limits.scratch_bytes)), "--tmpfs", "/scratch", "--symlink", "/scratch", "/tmp"]
        return args

    def run(self, job: dict, stdin: bytes | None, limits: Limits, owner: object = None) -> Run:
        """Run ``job`` (see harness.py) in a fresh sandbox; ``owner`` tags the process for `process.kill_all`."""
        mounts = [["/scratch", int(limits.scratch_bytes), limits.tmpfs_inodes]]
        mounts += [["/dev/shm", int(limits.shm_bytes), limits.tmpfs_inodes]]
        lifeline, held = lifeline_pipe()
        harness_fd = _memfd("harness", HARNESS_SOURCE)
        job_fd = _memfd("job", marshal.dumps({**job, "mounts": mounts, "lifeline": lifeline}, JOB_FORMAT))
        filter_fd = _memfd("seccomp", filter_program())
        info_read, info_write = os.pipe()
        first = FirstProcess(info_read)
        environment = []
        for key, value in {**_SANDBOX_ENV, "HOME": "/scratch", "TMPDIR": "/scratch"}.items():
            environment += ["--setenv", key, value]
        argv = [
            self.bwrap,
            "--unshare-all",
            "--unshare-user",
            "--disable-userns",
            "--as-pid-1",  # no init of bubblewrap's own: it would outlive bwrap as a zombie nobody reaps
            "--die-with-parent",
            "--new-session",
            "--cap-drop",
            "ALL",
            "--cap-add",  # for the harness's mounts and its bounding-set drop; it then drops every capability
            "CAP_SYS_ADMIN",
            "--cap-add",
            "CAP_SETPCAP",
            "--seccomp",
            str(filter_fd),
            "--hostname",
            "sandbox",
            *self._mounts(limits),
            "--ro-bind-data",
            str(harness_fd),
            "/sandbox/harness.py",
            "--ro-bind-data",
            str(job_fd),
            "/sandbox/job",
            "--remount-ro",
            "/",
            "--chdir",
            "/scratch",
            "--clearenv",
            *environment,
            "--info-fd",
            str(info_write),
            "--",
            *_python_argv(self.python),
            "/sandbox/harness.py",
            "/sandbox/job",
        ]
        try:
            try:
                finished = run_command(
                    argv,
                    stdin=stdin,
                    wall_time_s=limits.wall_time_s,
                    output_bytes=limits.output_bytes,
                    env={},
                    pass_fds=(harness_fd, job_fd, filter_fd, info_write, lifeline),
                    user=self.user,
                    owner=owner,
                    stop=first.stop,
                )
            except OSError as error:  # bwrap itself could not be started
                return Run(Finished.not_started(), refused=f"{self.bwrap}: {error}")
            os.close(info_write)
            info_write = -1
            started = first.info()
        finally:
            first.close()
            for fd in (harness_fd, job_fd, filter_fd, info_write, lifeline, held):
                if fd >= 0:
                    os.close(fd)
        if finished.returncode == SETUP_EXIT_CODE and finished.stderr.startswith(b"sandbox setup failed: "):
            # The harness's setup failed before the candidate ran (a candidate that prints this and exits 87 only
            # scores 0 uncached).
            return Run(finished, refused=finished.stderr.decode(errors="replace").strip())
        if started or finished.timed_out or finished.flooded:
            return Run(finished)
        return Run(finished, refused=finished.stderr.decode(errors="replace").strip() or "bubblewrap did not start")


class FirstProcess:
    """The sandbox's first process (the harness), by the host pid that bubblewrap writes to ``--info-fd``.

    Stopping a sandbox kills it first: bubblewrap, its parent, reaps it and exits. Killed the other way round, it
    would be orphaned to the nearest subreaper or PID 1 (the trainer, in a container without an init) and stay a zombie
    there.
    """

    def __init__(self, info_fd: int):
        self._fd, self._info, self._lock = info_fd, b"", threading.Lock()
        os.set_blocking(info_fd, False)

    def info(self) -> bytes:
        """What bubblewrap has written so far: nothing until the sandbox exists."""
        with self._lock:
            try:
                while self._fd >= 0 and (chunk := os.read(self._fd, 4096)):
                    self._info += chunk
            except BlockingIOError:
                pass
            return self._info

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)
            self._fd = -1

    def stop(self, bwrap: subprocess.Popen) -> bool:
        """SIGKILL the harness; False when there is none to kill (not started yet, or already reaped)."""
        try:
            pid = int(json.loads(self.info())["child-pid"])
            pidfd = os.pidfd_open(pid)
        except (ValueError, KeyError, TypeError, OSError):
            return False
        try:
            # Still bubblewrap's child, so not reaped: the pidfd names the harness, not a process that reused its pid.
            stat = Path(f"/proc/{pid}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != bwrap.pid:
                return False
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            return True
        except (OSError, IndexError, ValueError):
            return False
        finally:
            os.close(pidfd)


class LocalBackend:
    """The explicit weaker mode: NOT a security boundary.

    The child runs as a plain subprocess in a new session with the same rlimits, a scrubbed environment and a
    throwaway working directory; as root it runs as ``nobody``. It can still read every world-readable file, reach the
    network (loopback included), see other processes, and keep a descendant alive that escaped the session. Use it
    only for code you would run anyway, on a machine where bubblewrap is unavailable.
    """

    name = "local"

    def __init__(self, python: str, user: int | None):
        self.python, self.user = python, user

    def run(self, job: dict, stdin: bytes | None, limits: Limits, owner: object = None) -> Run:
        run_dir = Path(tempfile.mkdtemp(prefix="trl-marl-sandbox-"))
        try:
            scratch = run_dir / "scratch"
            scratch.mkdir()
            (run_dir / "harness.py").write_bytes(HARNESS_SOURCE)
            # No pid namespace here: the harness asks the kernel to SIGKILL it when the trainer dies.
            (run_dir / "job").write_bytes(marshal.dumps({**job, "parent_pid": os.getpid()}, JOB_FORMAT))
            os.chmod(run_dir, 0o755)
            for name in ("harness.py", "job"):
                os.chmod(run_dir / name, 0o644)
            if self.user is not None:
                os.chown(scratch, self.user, self.user)
            env = {**_SANDBOX_ENV, "HOME": str(scratch), "TMPDIR": str(scratch)}
            argv = [*_python_argv(self.python), str(run_dir / "harness.py"), str(run_dir / "job")]
            finished = run_command(
                argv,
                stdin=stdin,
                wall_time_s=limits.wall_time_s,
                output_bytes=limits.output_bytes,
                env=env,
                cwd=str(scratch),
                user=self.user,
                owner=owner,
            )
            return Run(finished)
        finally:
            remove_tree(run_dir)  # never follows what the child planted; logs, never raises, a failure
