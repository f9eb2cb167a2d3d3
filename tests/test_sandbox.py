"""The sandbox API: results, scoring, limits, the capability probe, failing closed, the local mode, and the pool."""

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
from sandbox_helpers import require_bubblewrap, sandbox_processes, wait_until_gone

from trl_marl.sandbox import (
    CallTest,
    ExecutionResult,
    Limits,
    Sandbox,
    SandboxUnavailable,
    Status,
    pass_rate,
    probe,
    stdout_matches,
    strict_equal,
)
from trl_marl.sandbox import executor as executor_module
from trl_marl.sandbox.harness import decode_plain, encode_plain
from trl_marl.sandbox.result import CallOutput

SHORT = Limits(wall_time_s=2.0, memory_bytes=256 * 2**20)


@pytest.fixture(scope="module")
def isolated():
    require_bubblewrap()
    return Sandbox("bubblewrap", limits=SHORT)


@pytest.fixture(scope="module")
def local():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Sandbox("local", limits=SHORT)


# Plain values and trusted comparison


def test_plain_values_round_trip_with_their_exact_types():
    value = [None, True, 3, 2.5, "s", (1, [2]), {"k": (3,)}, {1, 2}, frozenset({4}), b"\x00\xff", float("inf")]
    decoded = decode_plain(encode_plain(value))
    assert decoded == value and [type(item) for item in decoded] == [type(item) for item in value]
    assert math.isnan(decode_plain(encode_plain(float("nan"))))


def test_encode_rejects_subclasses_and_objects_and_decode_rejects_unknown_tags():
    class Sly(int):
        pass

    for value in (Sly(1), object(), [1, object()], {"k": Sly(2)}):
        with pytest.raises(TypeError, match="not a plain value"):
            encode_plain(value)
    for data in ({"object": []}, {"tuple": [1], "extra": 1}, {"float": "1e400x"}, float("nan")):
        with pytest.raises(ValueError):
            decode_plain(data)


@pytest.mark.parametrize(
    "expected,actual,equal",
    [
        (1, 1, True),
        (1, True, False),
        (1, 1.0, False),
        ((1, 2), [1, 2], False),
        ({"a": [1, (2,)]}, {"a": [1, (2,)]}, True),
        ({"a": 1}, {"a": 1, "b": 2}, False),
        (0.1 + 0.2, 0.3, True),
        (0.3, 0.31, False),
        (float("nan"), float("nan"), True),
        ([1, 2], [1, 2, 3], False),
        ({1, "a"}, {"a", 1}, True),
        ({1}, {True}, False),  # 1 == True, but a set of bools is not a set of ints
        ({(1,)}, {(1.0,)}, False),
        (frozenset({frozenset({1})}), frozenset({frozenset({True})}), False),
        ({1: "x"}, {True: "x"}, False),
        ({float("nan")}, {float("nan")}, True),
    ],
)
def test_strict_equal_checks_types_exactly(expected, actual, equal):
    assert strict_equal(expected, actual) is equal


def _result(status=Status.OK, outputs=None, stdout=""):
    return ExecutionResult(status, backend="test", outputs=outputs, stdout=stdout)


def test_pass_rate_is_the_fraction_of_exact_matches_and_zero_unless_ok():
    outputs = [CallOutput(3), CallOutput(error="ValueError: x"), CallOutput(5)]
    assert pass_rate(_result(outputs=outputs), [3, 4, 5]) == pytest.approx(2 / 3)
    assert pass_rate(_result(Status.TIMEOUT, outputs=outputs), [3, 4, 5]) == 0.0
    assert pass_rate(_result(outputs=outputs[:2]), [3, 4, 5]) == 0.0  # a missing result fails every test
    assert pass_rate(_result(outputs=outputs + [CallOutput(6)]), [3, 4, 5]) == 0.0  # so does an extra one


def test_stdout_matches_compares_every_line():
    assert stdout_matches(_result(stdout="a  \nb\n\n"), "a\nb")
    assert not stdout_matches(_result(stdout="a\nb\nc\n"), "a\nb\n")
    assert not stdout_matches(_result(stdout="a\n"), "a\nb\n")
    assert not stdout_matches(_result(Status.ERROR, stdout="a\n"), "a\n")


def test_limits_name_the_bad_field():
    for kwargs, field in [
        ({"wall_time_s": 0}, "wall_time_s"),
        ({"memory_bytes": -1}, "memory_bytes"),
        ({"max_processes": 2}, "max_processes"),
        ({"cpu_time_s": 0}, "cpu_time_s"),
        ({"max_open_files": 3}, "max_open_files"),
    ]:
        with pytest.raises(ValueError, match=field):
            Limits(**kwargs)
    assert Limits(wall_time_s=2.5).rlimits()["RLIMIT_CPU"] == 3


# Running code


@pytest.mark.parametrize("backend", ["isolated", "local"])
def test_program_and_function_calls_run_with_structured_results(backend, request):
    sandbox = request.getfixturevalue(backend)
    result = sandbox.run("import sys\nprint(input().upper())\nprint('warn', file=sys.stderr)", stdin="hi\n")
    assert (result.status, result.stdout, result.stderr, result.returncode) == (Status.OK, "HI\n", "warn\n", 0)
    assert result.backend == sandbox.backend.name and result.wall_time_s > 0
    calls = sandbox.call("def f(x):\n    print('noise')\n    return 10 // x", "f", [(2,), (0,), ("a",)])
    assert calls.ok and calls.outputs[0] == CallOutput(5) and "noise" in calls.stderr
    assert calls.outputs[1].error.startswith("ZeroDivisionError") and calls.outputs[2].error.startswith("TypeError")
    assert sandbox.call("x = 1", "f", [(1,)]).outputs[0].error.startswith("NameError")
    failed = sandbox.run("raise SystemExit(3)")
    assert failed.status is Status.ERROR and failed.returncode == 3 and "status 3" in failed.reason
    assert sandbox.check("def add(a, b):\n    return a + b", "add", [CallTest((1, 2), 3), CallTest((2, 2), 5)]) == 0.5


@pytest.mark.parametrize("backend", ["isolated", "local"])
def test_limits_hold_in_both_backends(backend, request):
    sandbox = request.getfixturevalue(backend)
    assert sandbox.run("while True:\n    pass").status is Status.TIMEOUT
    assert sandbox.run("bytearray(10**10)").status is Status.MEMORY
    flood = sandbox.run("while True:\n    print('x' * 1000)", limits=Limits(wall_time_s=5, output_bytes=10_000))
    assert flood.status is Status.KILLED and flood.stdout_truncated and len(flood.stdout) == 10_000
    cpu = sandbox.run("while True:\n    pass", limits=Limits(wall_time_s=10, cpu_time_s=1))
    assert cpu.status is Status.TIMEOUT and "CPU" in cpu.reason
    environment = sandbox.run("import os\nprint(sorted(os.environ))").stdout
    assert "TRL_MARL_TEST" not in environment and "HF_HUB_OFFLINE" not in environment


def test_local_mode_warns_that_it_is_not_a_security_boundary():
    with pytest.warns(UserWarning, match="not a security boundary"):
        Sandbox("local")


def test_local_mode_removes_its_files(local, shared_tmp):
    result = local.run("import os\nos.makedirs('a/b')\nopen('a/b/f', 'w').write('x')\nos.chmod('a', 0)\nprint('ok')")
    assert result.stdout == "ok\n"
    assert list(shared_tmp.iterdir()) == []


# The probe and failing closed


def test_probe_reports_missing_bubblewrap_and_the_sandbox_refuses(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    probe.cache_clear()
    try:
        capability = probe()
        assert capability.backend is None and "not installed" in capability.reason
        with pytest.raises(SandboxUnavailable, match="backend='local'"):
            Sandbox()
    finally:
        probe.cache_clear()


def test_a_bubblewrap_that_cannot_create_namespaces_fails_closed(monkeypatch, shared_tmp):
    fake = shared_tmp / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shared_tmp}:{os.environ['PATH']}")
    probe.cache_clear()
    try:
        capability = probe()
        assert capability.backend is None and "setting up uid map: Permission denied" in capability.reason
        with pytest.raises(SandboxUnavailable, match="uid map"):
            Sandbox("bubblewrap")
    finally:
        probe.cache_clear()


def test_a_bubblewrap_without_disable_userns_is_reported_as_too_old(monkeypatch, shared_tmp):
    fake = shared_tmp / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Unknown option --disable-userns' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shared_tmp}:{os.environ['PATH']}")
    probe.cache_clear()
    try:
        capability = probe()
        assert capability.backend is None and "bubblewrap >= 0.8" in capability.reason
        with pytest.raises(SandboxUnavailable, match="too old"):
            Sandbox("bubblewrap")
    finally:
        probe.cache_clear()


def test_a_run_whose_sandbox_cannot_start_is_refused_not_run(isolated, monkeypatch, shared_tmp):
    fake = shared_tmp / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(isolated.backend, "bwrap", str(fake))
    result = isolated.run("print('ran')")
    assert result.status is Status.REFUSED and "Creating new namespace failed" in result.reason
    assert pass_rate(result, ["ran"]) == 0.0
    monkeypatch.setattr(isolated.backend, "bwrap", "/nonexistent/bwrap")
    assert isolated.run("print('ran')").status is Status.REFUSED


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="'bubblewrap'.*'local'"):
        Sandbox("docker")


@pytest.mark.parametrize("backend", ["isolated", "local"])
def test_runs_are_reproducible_and_cannot_import_the_harness(backend, request):
    sandbox = request.getfixturevalue(backend)
    source = "print(hash('trl_marl'), list({'b', 'a', 'c', 'd'}))\nimport harness"
    first, second = sandbox.run(source), sandbox.run(source)
    assert first.stdout == second.stdout and first.stdout  # PYTHONHASHSEED=0 holds inside
    assert first.status is Status.ERROR and "No module named 'harness'" in first.stderr


@pytest.mark.parametrize("backend", ["isolated", "local"])
def test_a_root_trainer_runs_code_as_nobody_without_groups(backend, request):
    uid = 65534 if os.geteuid() == 0 else os.geteuid()  # RLIMIT_NPROC does not bind root
    result = request.getfixturevalue(backend).run("import os\nprint(os.getuid(), os.geteuid(), os.getgroups())")
    assert result.stdout.split(" ", 2)[:2] == [str(uid), str(uid)]
    if os.geteuid() == 0:
        assert result.stdout.endswith(" []\n")


REAPED = """
import ctypes, os, sys
ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of our sandboxes would come to us, as to a PID 1
from trl_marl.sandbox import Sandbox
sandbox = Sandbox("bubblewrap")
results = [sandbox.run("import os\\nos.fork() or os._exit(0)\\nprint('hi')") for _ in range(3)]
assert all(result.ok for result in results), results
orphans = []
while True:
    try:
        pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if pid == 0:
        break
    orphans.append(pid)
print(len(orphans))
"""


def test_bubblewrap_runs_leave_no_orphan_for_a_pid_1_trainer_to_reap(isolated):
    # A trainer that is PID 1 of its container reaps every orphan or collects zombies until no process can start.
    done = subprocess.run([sys.executable, "-c", REAPED], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "0\n"


# The pool


def _overlap(results) -> int:
    """Most runs alive at one moment, from the monotonic start/end times each run printed."""
    spans = [tuple(map(float, result.stdout.split())) for result in results]
    return max(sum(start <= moment < end for start, end in spans) for moment, _ in spans)


SPAN = "import time\nstart = time.monotonic()\ntime.sleep(0.4)\nprint(start, time.monotonic())"


def test_run_many_runs_concurrently_within_max_workers(isolated):
    sandbox = Sandbox("bubblewrap", limits=SHORT, max_workers=2)
    results = sandbox.run_many([SPAN] * 6)
    sandbox.close()
    assert all(result.ok for result in results)
    assert _overlap(results) == 2


def test_the_concurrency_limit_is_global_over_sandboxes(isolated, monkeypatch):
    monkeypatch.setattr(executor_module, "_SLOTS", threading.BoundedSemaphore(1))
    first, second = Sandbox("bubblewrap", limits=SHORT), Sandbox("bubblewrap", limits=SHORT)
    results = []
    threads = [threading.Thread(target=lambda s=s: results.extend(s.run_many([SPAN] * 2))) for s in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and _overlap(results) == 1


def test_closing_one_sandbox_leaves_the_runs_of_another_alone(isolated):
    other = Sandbox("bubblewrap", limits=SHORT, max_workers=2)
    closed = Sandbox("bubblewrap", limits=SHORT, max_workers=2)
    closed.run_many(["print(1)"])  # starts its pool
    results = []
    worker = threading.Thread(target=lambda: results.extend(other.run_many([SPAN] * 2)))
    worker.start()
    time.sleep(0.2)
    closed.close()
    worker.join()
    other.close()
    assert [result.status for result in results] == [Status.OK, Status.OK]


def test_results_come_back_in_order_and_check_many_scores_each(isolated):
    sources = [f"def f(x):\n    return x + {offset}" for offset in range(4)]
    assert isolated.check_many([(source, "f", [CallTest((1,), 2)]) for source in sources]) == [0.0, 1.0, 0.0, 0.0]
    results = isolated.run_many([f"print({index})" for index in range(5)], stdins=[None] * 5)
    assert [result.stdout for result in results] == [f"{index}\n" for index in range(5)]


# Each moment is reached exactly, from inside the trainer: the interrupt lands while the pool is still being filled
# (two runs started, the last item not yet submitted), or once every worker runs, or outside `map` while another
# thread's runs go on and more are queued (the interpreter exits with them); or the trainer is SIGKILLed then. A run
# counts as started once its harness runs (under bubblewrap: has replaced bubblewrap's child, which asks to die with
# bubblewrap only just before that).
INTERRUPTED = """
import concurrent.futures, signal, sys, threading, time, warnings
warnings.simplefilter("ignore")
# Ctrl-C raises KeyboardInterrupt here also when the tests run as a background job, which starts with SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
from trl_marl.sandbox import Limits, Sandbox, process
backend, moment = sys.argv[1:]
sandbox = Sandbox(backend, limits=Limits(wall_time_s=120), max_workers=2)
SOURCES = ["import time\\ntime.sleep(100)"] * 4

def harness_runs(pid):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
        if b"python" in argv[0].rsplit(b"/", 1)[-1] and any(arg.endswith(b"harness.py") for arg in argv):
            return True
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return False
    return any(harness_runs(int(child)) for child in children)

def when_both_run(then):
    deadline = time.monotonic() + 60
    while sum(harness_runs(command.pid) for command in list(process._LIVE)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    then()

def interrupt():
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

if moment == "filling":
    submit = concurrent.futures.ThreadPoolExecutor.submit
    submitted = []

    def submit_until_interrupted(pool, *args, **kwargs):
        submitted.append(args)
        if len(submitted) == 4:
            when_both_run(interrupt)
            time.sleep(30)  # the KeyboardInterrupt is raised here
        return submit(pool, *args, **kwargs)

    concurrent.futures.ThreadPoolExecutor.submit = submit_until_interrupted
elif moment == "running":
    threading.Thread(target=when_both_run, args=(interrupt,), daemon=True).start()
elif moment == "exiting":
    threading.Thread(target=sandbox.run_many, args=(SOURCES,)).start()
    when_both_run(interrupt)
    time.sleep(30)  # the KeyboardInterrupt is raised here, and the interpreter exits
else:
    threading.Thread(target=when_both_run, args=(lambda: print("running", flush=True),), daemon=True).start()
sandbox.run_many(SOURCES)
"""


@pytest.mark.parametrize("backend", ["bubblewrap", pytest.param("local", marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "moment",
    [
        "filling",
        pytest.param("running", marks=pytest.mark.slow),
        pytest.param("exiting", marks=pytest.mark.slow),
        "killed",
    ],
)
def test_an_interrupted_or_killed_trainer_leaves_no_sandbox_behind(backend, moment, shared_tmp, isolated):
    before = sandbox_processes()
    trainer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(INTERRUPTED), backend, moment],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(shared_tmp)},
        text=True,
    )
    if moment == "killed":
        assert trainer.stdout.readline() == "running\n"
        trainer.kill()
    try:
        _, stderr = trainer.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        trainer.kill()
        trainer.communicate()
        pytest.fail(f"the trainer had not exited 30 s after the interrupt ({moment}): a Ctrl-C must end it promptly")
    if moment != "killed":
        assert "KeyboardInterrupt" in stderr, stderr
        assert list(shared_tmp.iterdir()) == []  # every run removed its files
    assert wait_until_gone(before, timeout_s=10) == set()


@pytest.mark.parametrize("backend, code", [("local", -signal.SIGKILL), ("bubblewrap", 128 + signal.SIGKILL)])
def test_a_sigkill_at_the_cpu_limit_is_a_timeout_even_a_tick_early_and_an_early_one_is_not(backend, code):
    from trl_marl.sandbox.process import Finished

    limits = Limits(wall_time_s=10, cpu_time_s=1)

    def classify(wall_time_s):
        return executor_module._classify(
            Finished(code, False, False, b"", b"", False, False, wall_time_s), limits, backend
        )

    # Tick-based CPU accounting charged 1 s of CPU after 0.9993 s of wall time (seen in CI): the CPU limit was reached.
    assert classify(0.9993)[:2] == (Status.TIMEOUT, signal.SIGKILL) and "CPU-time limit of 1 s" in classify(0.9993)[2]
    assert classify(1.4)[0] is Status.TIMEOUT
    # Half a second in, the process cannot have used 1 s of CPU: something else killed it.
    assert classify(0.5) == (Status.KILLED, signal.SIGKILL, "killed by signal SIGKILL")
