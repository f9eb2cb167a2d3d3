"""Hostile code against the bubblewrap sandbox: every snippet is contained.

Each test checks its own status and score; the autouse ``guard`` fixture checks, for every test, that the trainer (this
process) and a sentinel process are alive, that no sandbox process is left behind, that no planted file changed and
no file appeared outside scratch, and the test asserts that the planted secrets are not in the output.

On a machine without usable bubblewrap these tests skip with the probe's reason; CI sets TRL_MARL_REQUIRE_BWRAP=1 so
that there the skip is a failure.
"""

import os
import shutil
import signal
import site
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest
from sandbox_helpers import require_bubblewrap, sandbox_processes, snapshot, wait_until_gone

from trl_marl.sandbox import CallTest, Limits, Sandbox, Status, stdout_matches

LIMITS = Limits(
    wall_time_s=2.0,
    memory_bytes=256 * 2**20,
    max_processes=16,
    scratch_bytes=8 * 2**20,
    shm_bytes=2 * 2**20,
    output_bytes=64 * 2**10,
)


@pytest.fixture(scope="module")
def sandbox():
    require_bubblewrap()
    return Sandbox("bubblewrap", limits=LIMITS)


class Guard:
    def __init__(self, monkeypatch):
        self.file_secret = f"file-secret-{uuid.uuid4().hex}"
        self.env_secret = f"env-secret-{uuid.uuid4().hex}"
        monkeypatch.setenv("TRL_MARL_TEST_SECRET", self.env_secret)
        # World-readable, so that only the sandbox's mount namespace keeps it away from uid nobody.
        # Outside /tmp: inside the sandbox /tmp is its own scratch.
        self.planted = Path(tempfile.mkdtemp(prefix="trl-marl-planted-", dir="/var/tmp"))
        self.planted.chmod(0o755)
        self.secret_path = self.planted / "secret.txt"
        self.secret_path.write_text(self.file_secret)
        (self.planted / "home").mkdir(mode=0o777)
        self.bashrc = self.planted / "home" / ".bashrc"
        self.bashrc.write_text("# planted\n")
        for path in (self.secret_path, self.bashrc):
            path.chmod(0o666)  # even writable: only the sandbox stops a write
        self.outside_target = Path(f"/tmp/trl-marl-pwned-{uuid.uuid4().hex}")
        self.pth_target = Path(site.getusersitepackages()) / f"trl_marl_pwned_{uuid.uuid4().hex}.pth"
        self.before = snapshot(self.planted)
        self.pids_before = sandbox_processes()
        self.sentinel = subprocess.Popen(["sleep", "120"])

    def assert_no_secret(self, result):
        for secret in (self.file_secret, self.env_secret):
            assert secret not in result.stdout and secret not in result.stderr

    def finish(self):
        try:
            assert self.sentinel.poll() is None, "the sentinel process outside the sandbox was killed"
            assert wait_until_gone(self.pids_before) == set(), "a sandbox process outlived its run"
            assert snapshot(self.planted) == self.before, "a file outside scratch changed"
            assert not self.outside_target.exists() and not self.pth_target.exists()
        finally:
            self.sentinel.kill()
            self.sentinel.wait()
            shutil.rmtree(self.planted)
            self.outside_target.unlink(missing_ok=True)
            self.pth_target.unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def guard(monkeypatch):
    guard = Guard(monkeypatch)
    yield guard
    guard.finish()


# Time and CPU


@pytest.mark.parametrize(
    "source",
    [
        "while True:\n    pass",
        "import time\ntime.sleep(100)",
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    time.sleep(0.01)",
        "import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')",
        "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(100)",
    ],
    ids=["infinite-loop", "sleep", "ignore-sigterm", "catastrophic-regex", "closed-stdout-hang"],
)
def test_runaway_program_times_out(sandbox, guard, source):
    result = sandbox.run(source)
    assert result.status is Status.TIMEOUT
    assert result.wall_time_s < LIMITS.wall_time_s + 1.5
    guard.assert_no_secret(result)


def test_input_without_stdin_fails_fast_and_with_stdin_reads_it(sandbox, guard):
    without = sandbox.run("print(input())")
    assert without.status is Status.ERROR and "EOFError" in without.stderr
    assert sandbox.run("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"


# Processes


def test_fork_bomb_is_bounded_and_killed(sandbox, guard):
    source = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = sandbox.run(source)
    assert result.status is Status.TIMEOUT


def test_double_fork_and_setsid_does_not_outlive_the_run(sandbox, guard):
    source = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    result = sandbox.run(source)
    assert result.status is Status.OK and result.stdout == "parent done\n"
    # guard.finish: the daemonised grandchild is gone


def test_thousands_of_threads_hit_the_process_limit(sandbox, guard):
    source = (
        "import threading, time\n"
        "started = 0\n"
        "try:\n"
        "    for _ in range(5000):\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "        started += 1\n"
        "finally:\n"
        "    print(started, flush=True)\n"
    )
    result = sandbox.run(source)
    assert result.status is Status.ERROR and "can't start new thread" in result.stderr
    assert int(result.stdout) < LIMITS.max_processes


def test_killing_the_parent_and_everything_reaches_nothing_outside(sandbox, guard):
    source = (
        "import os, signal\n"
        f"for pid in (os.getppid(), {os.getpid()}, {guard.sentinel.pid}):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        print(pid, 'sent')\n"
        "    except OSError as error:\n"
        "        print(pid, type(error).__name__)\n"
        "try:\n"
        "    os.kill(-1, signal.SIGKILL)\n"
        "except OSError as error:\n"
        "    print('kill(-1)', type(error).__name__)\n"
    )
    result = sandbox.run(source)
    assert f"{os.getpid()} ProcessLookupError" in result.stdout  # the trainer's pid does not exist in there
    assert f"{guard.sentinel.pid} ProcessLookupError" in result.stdout
    assert result.status is Status.OK  # kill(-1) spares the caller; nothing else in its namespace was left
    # guard.finish: this process and the sentinel are alive


def test_nested_user_namespace_is_refused(sandbox, guard):
    source = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))\n"  # CLONE_NEWUSER
        "print(os.system('unshare -U true 2>/dev/null'))\n"
    )
    result = sandbox.run(source)
    lines = result.stdout.splitlines()
    assert result.status is Status.OK and lines[0].startswith("-1 ")
    assert lines[1] != "0"


# Memory and disk


def test_memory_bomb_hits_the_memory_limit(sandbox, guard):
    for source in ("bytearray(10**10)", "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))"):
        result = sandbox.run(source)
        assert result.status is Status.MEMORY, source


def test_each_child_process_is_held_to_the_memory_limit(sandbox, guard):
    source = (
        "import os\n"
        "children = []\n"
        "for _ in range(8):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            block = bytearray(700 * 2**20)\n"
        "            os._exit(0)\n"
        "        except MemoryError:\n"
        "            os._exit(1)\n"
        "    children.append(pid)\n"
        "print(sum(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0 for pid in children))\n"
    )
    result = sandbox.run(source)
    assert result.status is Status.OK and result.stdout == "0\n"  # no child got 700 MiB


@pytest.mark.parametrize("directory,limit", [("/scratch", LIMITS.scratch_bytes), ("/dev/shm", LIMITS.shm_bytes)])
def test_filling_scratch_or_shm_stops_at_its_size(sandbox, guard, directory, limit):
    source = (
        "import os\n"
        "written = 0\n"
        "try:\n"
        "    for index in range(1000):\n"
        f"        with open('{directory}/f%d' % index, 'wb') as handle:\n"
        "            written += handle.write(b'x' * 2**20)\n"
        "except OSError as error:\n"
        "    print(written, error.errno)\n"
    )
    result = sandbox.run(source)
    written, errno_value = map(int, result.stdout.split())
    assert written <= limit and errno_value in (27, 28)  # EFBIG, ENOSPC


def test_deep_c_recursion_segfault_is_reported_as_killed(sandbox, guard):
    source = (
        "import sys\n"
        "sys.setrecursionlimit(10**9)\n"
        "nested = []\n"
        "for _ in range(10**6):\n"
        "    nested = [nested]\n"
        "repr(nested)\n"
    )
    result = sandbox.run(source)
    assert result.status in (Status.KILLED, Status.MEMORY)
    if result.status is Status.KILLED:
        assert result.signal == signal.SIGSEGV


def test_output_flood_is_capped_and_killed(sandbox, guard):
    result = sandbox.run("while True:\n    print('x' * 10000)")
    assert result.status is Status.KILLED and result.stdout_truncated
    assert len(result.stdout) <= LIMITS.output_bytes


# Files, secrets, network


def test_writes_outside_scratch_do_not_reach_the_host(sandbox, guard):
    in_tmp = guard.outside_target  # /tmp/...: inside the sandbox that is its own scratch, so this write lands there
    targets = [guard.bashrc, guard.secret_path, in_tmp, guard.pth_target, Path("/usr/lib/pwned"), Path("/pwned")]
    source = (
        "import os\n"
        f"for path in {[str(target) for target in targets]!r}:\n"
        "    try:\n"
        "        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
        "        with open(path, 'a') as handle:\n"
        "            handle.write('pwned')\n"
        "        print('wrote', path)\n"
        "    except OSError as error:\n"
        "        print('blocked', path, type(error).__name__)\n"
    )
    result = sandbox.run(source)
    assert result.status is Status.OK
    assert result.stdout.splitlines() == [
        f"wrote {target}" if target == in_tmp else f"blocked {target} OSError" for target in targets
    ]
    # guard.finish: the planted files are unchanged and no target exists on the host


def test_planted_secret_file_and_parent_environment_are_unreadable(sandbox, guard):
    source = (
        "import os\n"
        f"for path in ({str(guard.secret_path)!r}, '/proc/1/environ', '/proc/{os.getpid()}/environ', '/etc/passwd'):\n"
        "    try:\n"
        "        print(open(path, errors='replace').read())\n"
        "    except OSError as error:\n"
        "        print('blocked', type(error).__name__)\n"
        "print(dict(os.environ))\n"
    )
    result = sandbox.run(source)
    lines = result.stdout.splitlines()
    assert result.status is Status.OK and lines[0] == lines[2] == lines[3] == "blocked FileNotFoundError"
    guard.assert_no_secret(result)


def test_loopback_listener_on_the_host_is_unreachable(sandbox, guard):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    port = listener.getsockname()[1]
    source = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    print('connected')\n"
        "except OSError as error:\n"
        "    print('blocked', type(error).__name__)\n"
    )
    try:
        result = sandbox.run(source)
        assert result.stdout.startswith("blocked")
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()


# Reward hacks: the score comes from the parent's comparison only


TESTS = [CallTest((3,), 93582), CallTest((4,), 71413)]  # expected values nobody can guess from the inputs


@pytest.mark.parametrize(
    "source",
    [
        "class Same:\n    def __eq__(self, other):\n        return True\n\ndef solve(x):\n    return Same()",
        "class Sly(int):\n    def __eq__(self, other):\n        return True\n\ndef solve(x):\n    return Sly(0)",
        'import sys\nprint(\'PASS\')\nprint(\'{"results": [{"value": 93582}, {"value": 71413}]}\')\nsys.exit(0)',
        "import os\nos._exit(0)",
        "def solve(x):\n    raise SystemExit(0)",
        "import os\ndef solve(x):\n    os.write(3, b'{\"results\": []}')\n    return 0",
        (
            "import gc, sys\n"
            "def solve(x):\n"
            "    frame = sys._getframe()\n"
            "    while frame:\n"
            "        for value in frame.f_locals.values():\n"
            "            if isinstance(value, list):\n"
            "                value.append({'value': 93582})\n"
            "        frame = frame.f_back\n"
            "    found = [o for o in gc.get_objects() if isinstance(o, dict) and 'expected' in o]\n"
            "    return found[0]['expected'] if found else -1\n"
        ),
    ],
    ids=["always-equal", "int-subclass", "fake-pass", "early-os-exit", "exit-in-call", "extra-output", "frame-walk"],
)
def test_reward_hack_scores_zero(sandbox, guard, source):
    assert sandbox.check(source, "solve", TESTS) == 0.0


def test_fake_pass_marker_and_prefix_do_not_match_expected_stdout(sandbox, guard):
    result = sandbox.run("print('42')\nprint('ALL TESTS PASSED')")
    assert not stdout_matches(result, "42\n")  # the whole output is compared, not a prefix
    assert stdout_matches(sandbox.run("print(6 * 7)"), "42\n")


def test_honest_solution_scores_against_the_same_tests(sandbox, guard):
    source = "def solve(x):\n    return {3: 93582, 4: 71413}[x]"
    assert sandbox.check(source, "solve", TESTS) == 1.0
    assert sandbox.check(source, "solve", [CallTest((3,), 93582), CallTest((4,), 0)]) == 0.5
