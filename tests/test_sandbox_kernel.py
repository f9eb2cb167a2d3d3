"""What namespaces alone do not isolate, each reproduced as an attack: the kernel keyrings, vsock, SysV IPC, memory
files, tmpfs inodes, capabilities, and the zombies a trainer running as PID 1 would collect.

Each attack that needs a capability of the host (a keyring, vsock) skips with the reason when the host lacks it: there
the sandbox cannot reach it either. CI sets TRL_MARL_REQUIRE_BWRAP=1, so that a missing sandbox fails instead.
"""

import ctypes
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
from sandbox_helpers import require_bubblewrap

from trl_marl.sandbox import Limits, Sandbox, SandboxUnavailable, Status, backends, capability, seccomp

LIMITS = Limits(wall_time_s=5.0, memory_bytes=64 * 2**20, scratch_bytes=8 * 2**20, tmpfs_inodes=200)


@pytest.fixture(scope="module")
def sandbox():
    require_bubblewrap()
    return Sandbox("bubblewrap", limits=LIMITS)


def run(sandbox, source):
    result = sandbox.run(textwrap.dedent(source))
    assert result.status is Status.OK, (result.status, result.reason, result.stderr[-500:])
    return result.stdout.split()


def _run_trainer(script: str, *args: str) -> str:
    """Run ``script`` as its own trainer process (a keyring or a reaper role must not leak into this one)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# Kernel keyrings: not namespaced. The trainer joins a session keyring holding a secret, as a pam_keyinit login, a
# systemd service or a Kerberos KEYRING cache would give it.
KEYRING_TRAINER = """
import ctypes, errno, sys, warnings
from trl_marl.sandbox import Sandbox

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
KEYCTL, ADD_KEY = 250, 248  # x86_64
if libc.syscall(KEYCTL, 1, b"trl-marl-test") < 0:  # KEYCTL_JOIN_SESSION_KEYRING
    print("skip", errno.errorcode[ctypes.get_errno()])
    sys.exit()
libc.syscall(ADD_KEY, b"user", b"trl-marl-secret", b"hunter2", 7, -3)  # into the session keyring
ATTACK = '''
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
key = libc.syscall(250, 10, -3, b"user", b"trl-marl-secret", 0)  # KEYCTL_SEARCH the session keyring
buffer = ctypes.create_string_buffer(64)
read = libc.syscall(250, 11, key, buffer, 64) if key >= 0 else -1  # KEYCTL_READ
print(buffer.value.decode() if read > 0 else "unread:" + errno.errorcode[ctypes.get_errno()])
added = libc.syscall(248, b"user", b"trl-marl-planted", b"x", 1, -3)
print("added" if added >= 0 else "unadded:" + errno.errorcode[ctypes.get_errno()])
'''
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    result = Sandbox(sys.argv[1]).run(ATTACK)
planted = libc.syscall(KEYCTL, 10, -3, b"user", b"trl-marl-planted", 0)
print(result.status.value, result.stdout.replace(chr(10), " "), "planted" if planted >= 0 else "clean")
"""


def test_the_trainers_session_keyring_is_out_of_reach():
    require_bubblewrap()
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8 or "x86_64" not in _machine():
        pytest.skip("the attack's syscall numbers are x86_64's")
    outcome = _run_trainer(KEYRING_TRAINER, "bubblewrap").split()
    if outcome[0] == "skip":
        pytest.skip(f"this process cannot use keyrings ({outcome[1]}): a sandbox could not reach one either")
    assert outcome == ["ok", "unread:EPERM", "unadded:EPERM", "clean"]


def _machine() -> str:
    import platform

    return platform.machine()


def test_sockets_of_every_family_but_unix_are_denied_vsock_and_tcp_included(sandbox):
    # vsock is not isolated by the network namespace (the VM's host is reachable from it); TCP grows its buffers past
    # any limit (16 processes held 1.45 GiB on the sandbox's own loopback). Both fail before the kernel sees them.
    stdout = run(
        sandbox,
        """
        import ctypes, errno, socket
        for family in (socket.AF_VSOCK, socket.AF_INET, socket.AF_INET6, socket.AF_NETLINK, socket.AF_PACKET):
            try:
                socket.socket(family, socket.SOCK_DGRAM).close()
                print("made")
            except OSError as error:
                print(errno.errorcode[error.errno])
        libc = ctypes.CDLL(None, use_errno=True)
        # socket(2) takes an int: the kernel reads only the low 32 bits of the family's register.
        fd = libc.syscall(41, (1 << 32) | socket.AF_VSOCK, socket.SOCK_STREAM, 0)
        print("opened" if fd >= 0 else errno.errorcode[ctypes.get_errno()])
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()  # Unix sockets stay usable
        socket.socketpair()
        print("unix")
        """,
    )
    assert stdout == ["EPERM"] * 6 + ["unix"]


def test_sysv_shared_memory_cannot_pin_memory_beyond_the_memory_limit(sandbox):
    # Detached segments belong to no process: 4 x 32 MiB would be held past the 64 MiB limit, out of the OOM
    # killer's sight. The calls that make any SysV object fail.
    stdout = run(
        sandbox,
        """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        pinned = 0
        for _ in range(4):
            segment = libc.shmget(0, 32 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
            if segment < 0:
                print("shmget:" + errno.errorcode[ctypes.get_errno()])
                break
            address = libc.shmat(segment, None, 0)
            ctypes.memset(address, 1, 32 << 20)
            libc.shmdt(ctypes.c_void_p(address))
            pinned += 32
        print(pinned)
        print("msgget:" + errno.errorcode[ctypes.get_errno()] if libc.msgget(0, 0o1600) < 0 else "queue")
        print("semget:" + errno.errorcode[ctypes.get_errno()] if libc.semget(0, 1, 0o1600) < 0 else "semaphore")
        """,
    )
    assert stdout == ["shmget:EPERM", "0", "msgget:EPERM", "semget:EPERM"]


def test_socket_and_pipe_buffers_stay_at_the_kernels_default_size(sandbox):
    # Data in flight counts against no limit: raised buffers would let 1024 descriptors hold net.core.wmem_max each.
    stdout = run(
        sandbox,
        """
        import errno, fcntl, os, socket
        first, _ = socket.socketpair()
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF, 32, 33):  # 32, 33: the *BUFFORCE variants
            try:
                first.setsockopt(socket.SOL_SOCKET, option, 1 << 22)
                print("raised")
            except OSError as error:
                print(errno.errorcode[error.errno])
        first.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # other options stay settable
        _, write = os.pipe()
        try:
            fcntl.fcntl(write, 1031, 1 << 20)  # F_SETPIPE_SZ
            print("raised")
        except OSError as error:
            print(errno.errorcode[error.errno])
        print(fcntl.fcntl(write, 1032))  # F_GETPIPE_SZ
        """,
    )
    assert stdout == ["EPERM"] * 5 + ["65536"]


def test_memory_files_outside_the_address_space_limit_are_denied(sandbox):
    stdout = run(
        sandbox,
        """
        import errno, os
        try:
            os.memfd_create("held")
            print("made")
        except OSError as error:
            print(errno.errorcode[error.errno])
        """,
    )
    assert stdout == ["EPERM"]


@pytest.mark.parametrize("directory", ["/scratch", "/dev/shm"])
def test_creating_files_stops_at_the_inode_cap(sandbox, directory):
    # 354k empty directories in 5 s held 350 MiB of kernel memory that no size limit counts.
    stdout = run(
        sandbox,
        f"""
        import errno, os
        made = 0
        try:
            while made < 5000:
                os.mkdir(f"{directory}/d{{made}}")
                made += 1
        except OSError as error:
            print(errno.errorcode[error.errno])
        print(made, os.statvfs("{directory}").f_files)
        """,
    )
    assert stdout[0] == "ENOSPC"
    assert int(stdout[1]) < LIMITS.tmpfs_inodes and int(stdout[2]) == LIMITS.tmpfs_inodes


def test_the_scratch_size_cap_still_holds_on_the_harness_mount(sandbox):
    # Files of 4 MiB each (under RLIMIT_FSIZE): only the tmpfs size stops them.
    stdout = run(
        sandbox,
        """
        import errno
        written = 0
        try:
            for index in range(4):
                with open(f"/tmp/fill{index}", "wb") as handle:
                    for _ in range(4):
                        handle.write(b"x" * (1 << 20))
                        handle.flush()
                        written += 1 << 20
        except OSError as error:
            print(errno.errorcode[error.errno])
        print(written)
        """,
    )
    assert stdout[0] == "ENOSPC" and int(stdout[1]) <= LIMITS.scratch_bytes


def test_the_candidate_holds_no_capability_and_cannot_mount(sandbox):
    # bubblewrap grants CAP_SYS_ADMIN and CAP_SETPCAP for the harness's mounts and its bounding-set drop; the harness
    # drops every capability from every set before the candidate's first line.
    stdout = run(
        sandbox,
        """
        import ctypes, errno
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
        names = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")
        print(*(status[name].strip() for name in names), status["Seccomp"].strip())
        libc = ctypes.CDLL(None, use_errno=True)
        print("unshared" if libc.unshare(0x00020000) == 0 else errno.errorcode[ctypes.get_errno()])
        mounted = libc.mount(b"tmpfs", b"/scratch", b"tmpfs", 0, b"")
        print("mounted" if mounted == 0 else errno.errorcode[ctypes.get_errno()])
        """,
    )
    assert stdout == ["0" * 16] * 5 + ["2", "EPERM", "EPERM"]


def test_posix_timers_stop_at_the_pending_signal_limit(sandbox):
    # Each POSIX timer holds a preallocated signal in kernel memory: 96k timers held 37 MiB without this limit.
    stdout = run(
        sandbox,
        """
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        timer = ctypes.c_void_p()
        made = 0
        while made < 10000 and libc.timer_create(1, None, ctypes.byref(timer)) == 0:  # CLOCK_MONOTONIC
            made += 1
        print(made, errno.errorcode.get(ctypes.get_errno(), "none"))
        """,
    )
    assert stdout == ["64", "EAGAIN"]


def test_the_probe_reports_the_filter_and_fails_closed_without_libseccomp(monkeypatch):
    require_bubblewrap()
    reason = capability.probe().reason
    assert "seccomp filter active" in reason and "keyrings" in reason and "sockets but AF_UNIX" in reason

    def missing():
        raise seccomp.SeccompUnavailable(
            "libseccomp is not installed (test): install it (`apt-get install libseccomp2`"
        )

    seccomp.filter_program.cache_clear()
    monkeypatch.setattr(seccomp, "_library", missing)
    try:
        found = capability.probe.__wrapped__()
        assert found.backend is None and "libseccomp is not installed" in found.reason
        monkeypatch.setattr(capability, "probe", capability.probe.__wrapped__)
        with pytest.raises(SandboxUnavailable, match="libseccomp"):
            Sandbox("bubblewrap")
    finally:
        seccomp.filter_program.cache_clear()


def test_the_filter_denies_each_listed_call_that_this_architecture_has():
    require_bubblewrap()
    program = seccomp.filter_program()
    assert program and len(program) % 8 == 0  # struct sock_filter: 8 bytes an instruction
    library = seccomp._library()
    known = [name for name in seccomp.DENIED if library.seccomp_syscall_resolve_name(name.encode()) >= 0]
    assert {"keyctl", "add_key", "request_key", "shmget", "msgget", "semget", "memfd_create"} <= set(known)


# A trainer that reaps orphans: PID 1 in a container without an init, or (as here) a child subreaper, which the kernel
# hands orphans to in the same way.
REAPER_TRAINER = """
import ctypes, sys, warnings
from pathlib import Path
from trl_marl.sandbox import Limits, Sandbox

ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    sandbox = Sandbox(sys.argv[1], limits=Limits(wall_time_s=1.5, max_processes=8, output_bytes=4096))
FORKING = "import os, time\\nfor _ in range(3):\\n    if os.fork() == 0:\\n        time.sleep(100)\\n"
statuses = [sandbox.run(FORKING + "while True:\\n    pass").status.value]  # timeout
statuses.append(sandbox.run(FORKING + "while True:\\n    print('x' * 1000)").status.value)  # output flood
statuses.append(sandbox.run(FORKING + "import os\\nos._exit(3)").status.value)  # exits, its children still running
zombies = []
for children in Path("/proc/self/task").glob("*/children"):
    for pid in children.read_text().split():
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            zombies.append(pid)
statuses += [sandbox.run("print('honest')").status.value for _ in range(3)]
print(*statuses, len(zombies))
"""


@pytest.mark.parametrize("backend", ["bubblewrap", pytest.param("local", marks=pytest.mark.slow)])
def test_a_trainer_that_reaps_orphans_keeps_no_zombie_and_honest_runs_still_run(backend):
    if backend == "bubblewrap":
        require_bubblewrap()
    outcome = _run_trainer(REAPER_TRAINER, backend).split()
    assert outcome == ["timeout", "killed", "error", "ok", "ok", "ok", "0"]


def test_local_mode_is_unchanged_by_the_bubblewrap_profile():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = Sandbox("local", limits=LIMITS)
    result = local.run("import os\nos.memfd_create('x')\nprint('local')")
    assert result.ok and result.stdout == "local\n"


def test_a_harness_whose_trainer_died_during_setup_never_runs_the_candidate(monkeypatch):
    # bubblewrap arms its die-with-parent signal only just before it starts the harness; a trainer SIGKILLed during
    # those milliseconds leaves no one to enforce the deadline. The harness sees the trainer's end of its lifeline
    # closed and exits before the candidate's first line.
    require_bubblewrap()

    def dead_trainer():
        read, write = os.pipe()
        os.close(write)
        return read, -1

    sandbox = Sandbox("bubblewrap", limits=LIMITS)
    monkeypatch.setattr(backends, "lifeline_pipe", dead_trainer)
    result = sandbox.run("print('ran')")
    assert (result.status, result.returncode, result.stdout) == (Status.ERROR, 1, "")
    monkeypatch.undo()
    assert sandbox.run("print('ran')").stdout == "ran\n"
