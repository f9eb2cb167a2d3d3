"""`Sandbox`: run model-written Python under hard limits, one sample or many at once under a global concurrency cap."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .capability import make_backend
from .harness import MEMORY_EXIT_CODE, PlainBoundError, PlainDecoder, encode_plain
from .process import kill_all
from .result import CallOutput, ExecutionResult, Limits, Status
from .scoring import MAX_SHARED_HASH, pass_rate


def max_concurrency() -> int:
    """Sandboxes that may run at once in this process, over all `Sandbox` objects: ``TRL_MARL_SANDBOX_CONCURRENCY``,
    else the number of CPU cores."""
    configured = os.environ.get("TRL_MARL_SANDBOX_CONCURRENCY")
    if configured is None:
        return os.cpu_count() or 1
    if not configured.isdigit() or int(configured) < 1:
        raise ValueError(f"TRL_MARL_SANDBOX_CONCURRENCY must be a positive integer, got {configured!r}.")
    return int(configured)


_SLOTS: threading.BoundedSemaphore | None = None  # made when the first sandbox runs, from max_concurrency()
_SLOTS_LOCK = threading.Lock()


def _slots() -> threading.BoundedSemaphore:
    global _SLOTS
    with _SLOTS_LOCK:
        if _SLOTS is None:
            _SLOTS = threading.BoundedSemaphore(max_concurrency())
        return _SLOTS


class _Batch:
    """The items of one `Sandbox.map` call. An item starts only while its batch is not stopped and the interpreter is
    not exiting; ``running`` counts the items started and not yet returned (their runs reaped, their files removed)."""

    def __init__(self, owner: Sandbox):
        self.owner, self.stopped, self.running = owner, False, 0

    def run(self, function: Callable[[Any], Any], item: Any) -> Any:
        global _items_running
        with _ITEMS_CHANGED:
            if self.stopped or _exiting:
                raise CancelledError("the sandbox was interrupted, closed, or the interpreter is exiting")
            self.running += 1
            _items_running += 1
        try:
            return function(item)
        finally:
            with _ITEMS_CHANGED:
                self.running -= 1
                _items_running -= 1
                _ITEMS_CHANGED.notify_all()


_BATCHES: set[_Batch] = set()  # the `map` calls under way
_ITEMS_CHANGED = threading.Condition()  # guards the batches and the two below; notified when an item returns
_items_running = 0  # over all batches
_exiting = False


def _stop(batches: Iterable[_Batch], owner: Sandbox) -> None:
    """Start no more items of ``batches``, and SIGKILL ``owner``'s runs until none of their items is running."""
    batches = list(batches)
    with _ITEMS_CHANGED:
        for batch in batches:
            batch.stopped = True
    _kill_until(lambda: not any(batch.running for batch in batches), owner)


def _kill_until(idle: Callable[[], bool], owner: Sandbox | None = None) -> None:
    """SIGKILL ``owner``'s runs (every run of the process when None) until ``idle()``, checked under `_ITEMS_CHANGED`.
    Killing repeatedly also catches a run that a worker was starting while a kill went out (its process not yet
    registered), which would otherwise run to its deadline."""
    while True:
        kill_all(owner=owner)
        with _ITEMS_CHANGED:
            if _ITEMS_CHANGED.wait_for(idle, timeout=0.05):
                return


def _stop_at_exit() -> None:
    """At interpreter exit, start no queued item and kill every run until no item is running.

    Registered with `threading._register_atexit`, as concurrent.futures registers the join of its worker threads, and
    after it, so it runs first (they run in reverse): that join would otherwise first run every queued item, each to
    its wall-time limit, while `atexit`'s `kill_all` comes only after it.
    """
    global _exiting
    with _ITEMS_CHANGED:
        _exiting = True
    _kill_until(lambda: _items_running == 0)


threading._register_atexit(_stop_at_exit)


_CPU_SIGNALS = (signal.SIGKILL, signal.SIGXCPU)
# The kernel charges CPU time by the scheduler tick, so a busy process can be charged its CPU limit a little before
# that much wall time has passed (CI once saw SIGKILL at 0.9993 s of wall time under a 1 s limit).
_CPU_ACCOUNTING_SLACK_S = 0.1


@dataclass(frozen=True)
class CallTest:
    """One test of a function: call it with ``args`` and expect exactly ``expected`` (see `strict_equal`)."""

    args: Sequence[Any]
    expected: Any


class Sandbox:
    """Runs untrusted Python code in isolation and returns structured results.

    Args:
        backend: ``"bubblewrap"`` (the default, an isolation boundary) or ``"local"`` (an explicit opt-in that is NOT a
            security boundary). Default: ``TRL_MARL_SANDBOX`` if set, else ``"bubblewrap"``. When bubblewrap cannot
            isolate code on this machine, the constructor raises `SandboxUnavailable` with the reason: it never falls
            back to running code unisolated.
        limits: the default `Limits` of every run (each call can pass its own).
        max_workers: runs this object starts at once in `run_many`/`call_many`; all `Sandbox` objects together stay
            within `max_concurrency()`.
        python: the interpreter for sandboxed code (default: this Python's base interpreter when the sandbox user can
            run it, else ``/usr/bin/python3``). Only its standard library is visible.

    Example:
        >>> sandbox = Sandbox()
        >>> sandbox.check("def add(a, b):\\n    return a + b", "add", [CallTest((1, 2), 3), CallTest((2, 2), 5)])
        0.5
    """

    def __init__(
        self,
        backend: str | None = None,
        limits: Limits | None = None,
        max_workers: int | None = None,
        python: str | None = None,
    ):
        name = backend or os.environ.get("TRL_MARL_SANDBOX", "bubblewrap")
        self.backend = make_backend(name, python)
        if self.backend.name == "local":
            warnings.warn(
                "trl_marl Sandbox(backend='local') is not a security boundary: model-written code can read your "
                "files, reach the network and outlive its run. Use it only for code you would run yourself.",
                stacklevel=2,
            )
        self.limits = limits or Limits()
        self.max_workers = min(max_workers or max_concurrency(), max_concurrency())
        self._pool: ThreadPoolExecutor | None = None

    # One run

    def run(self, source: str, stdin: str | bytes | None = None, limits: Limits | None = None) -> ExecutionResult:
        """Run ``source`` as a Python program (``__main__``), with ``stdin`` as its standard input (default: empty)."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        return self._execute({"mode": "program", "source": source}, stdin, limits or self.limits)

    def call(
        self, source: str, entry_point: str, calls: Sequence[Sequence[Any]], limits: Limits | None = None
    ) -> ExecutionResult:
        """Execute ``source``, then call ``entry_point(*args)`` for each ``args`` in ``calls``. A run that ends ok has
        ``outputs``: one `CallOutput` per call, in order (plain return value, or the exception it raised)."""
        encoded_calls = [encode_plain(list(args)) for args in calls]
        job = {"mode": "calls", "source": source, "entry_point": entry_point, "calls": encoded_calls}
        return self._execute(job, None, limits or self.limits)

    def check(
        self, source: str, entry_point: str, tests: Sequence[CallTest], limits: Limits | None = None, **tolerance
    ) -> float:
        """Fraction of ``tests`` whose call returned exactly the expected value; 0.0 for a run that did not end ok.
        ``tolerance``: ``rel_tol``/``abs_tol`` for floats (see `strict_equal`)."""
        result = self.call(source, entry_point, [test.args for test in tests], limits)
        return pass_rate(result, [test.expected for test in tests], **tolerance)

    # Many runs

    def run_many(self, sources: Sequence[str], stdins: Sequence[str | bytes | None] | None = None, limits=None):
        """`run` for each source, concurrently; results in order."""
        stdins = stdins if stdins is not None else [None] * len(sources)
        return self.map(lambda pair: self.run(pair[0], pair[1], limits), zip(sources, stdins))

    def call_many(self, requests: Sequence[tuple[str, str, Sequence[Sequence[Any]]]], limits=None):
        """`call` for each ``(source, entry_point, calls)``, concurrently; results in order."""
        return self.map(lambda request: self.call(*request, limits=limits), requests)

    def check_many(self, requests: Sequence[tuple[str, str, Sequence[CallTest]]], limits=None, **tolerance):
        """`check` for each ``(source, entry_point, tests)``, concurrently; pass rates in order."""
        return self.map(lambda request: self.check(*request, limits=limits, **tolerance), requests)

    def map(self, function: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """`function(item)` for each item on this sandbox's worker threads (within `max_concurrency()` runs at once),
        results in order. For scoring that runs code in the sandbox and does more around it; on an interruption,
        wherever it lands (the pool still being filled included), no further item starts and the sandbox's runs are
        killed and cleaned up before the exception propagates."""
        batch = _Batch(self)
        try:  # everything, submitting included: an interrupt can land while items are still being submitted
            with _ITEMS_CHANGED:
                _BATCHES.add(batch)
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="trl-marl-sandbox")
            pool = self._pool  # `close` from another thread sets it to None; the pool itself then refuses new items
            futures: list[Future] = [pool.submit(batch.run, function, item) for item in items]
            return [future.result() for future in futures]
        except BaseException:
            # Interrupted (or an item failed): start nothing new, kill what runs, wait until each run has reaped its
            # processes and removed its files, then re-raise. A second interrupt meanwhile leaves the rest to
            # `_stop_at_exit`.
            _stop([batch], owner=self)
            raise
        finally:
            with _ITEMS_CHANGED:
                _BATCHES.discard(batch)

    def close(self) -> None:
        """Kill this object's running sandboxes, start none of its queued items, and stop its worker threads."""
        with _ITEMS_CHANGED:
            batches = [batch for batch in _BATCHES if batch.owner is self]
        _stop(batches, owner=self)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # Internals

    def _execute(self, job: dict, stdin: bytes | None, limits: Limits) -> ExecutionResult:
        with _slots():
            run = self.backend.run({**job, "rlimits": limits.rlimits()}, stdin, limits, owner=self)
        finished = run.finished
        common = dict(
            backend=self.backend.name,
            stdout=finished.stdout.decode(errors="replace"),
            stderr=finished.stderr.decode(errors="replace"),
            stdout_truncated=finished.stdout_truncated,
            stderr_truncated=finished.stderr_truncated,
            wall_time_s=finished.wall_time_s,
        )
        if run.refused:
            return ExecutionResult(Status.REFUSED, reason=run.refused, **common)
        status, signal_number, reason = _classify(finished, limits, self.backend.name)
        outputs = None
        if status is Status.OK and job["mode"] == "calls":
            # Parsing is the trainer's own work, but it counts in the run's time: the bounds keep it linear in the
            # output, and a run whose parse still ends past the wall-time limit is a timeout.
            parse_started = time.monotonic()
            try:
                with _collector_paused():
                    outputs = _parse_outputs(finished.stdout, len(job["calls"]))
            except ValueError as error:
                status, reason = Status.ERROR, str(error)
            common["wall_time_s"] += time.monotonic() - parse_started
            if common["wall_time_s"] > limits.wall_time_s:
                status, outputs = Status.TIMEOUT, None
                reason = f"parsing the call results took the rest of the wall-time limit of {limits.wall_time_s:g} s"
        return ExecutionResult(
            status,
            returncode=finished.returncode,
            signal=signal_number,
            reason=reason,
            outputs=outputs,
            **common,
        )


def _classify(finished, limits: Limits, backend: str) -> tuple[Status, int | None, str]:
    if finished.timed_out:
        return Status.TIMEOUT, signal.SIGKILL, f"wall-time limit of {limits.wall_time_s:g} s reached"
    if finished.flooded:
        return Status.KILLED, signal.SIGKILL, f"printed more than {limits.output_bytes} bytes"
    code = finished.returncode
    # bubblewrap reports a child killed by signal N as exit status 128 + N; a direct child has a negative code
    signal_number = -code if code < 0 else code - 128 if backend == "bubblewrap" and 128 < code < 160 else None
    if signal_number is not None:
        # The kernel SIGKILLs a process at its CPU-time limit; it cannot have used (much) more CPU than wall time.
        if signal_number in _CPU_SIGNALS and finished.wall_time_s >= limits.cpu_seconds - _CPU_ACCOUNTING_SLACK_S:
            return Status.TIMEOUT, signal_number, f"CPU-time limit of {limits.cpu_seconds} s reached"
        name = signal.Signals(signal_number).name if signal_number in signal.valid_signals() else signal_number
        return Status.KILLED, signal_number, f"killed by signal {name}"
    if code == MEMORY_EXIT_CODE or finished.stderr.rstrip().endswith(b"MemoryError"):
        return Status.MEMORY, None, f"memory limit of {limits.memory_bytes} bytes per process reached"
    if code != 0:
        return Status.ERROR, None, f"exited with status {code}"
    return Status.OK, None, ""


# Bounds of one run's results document, besides its size (Limits.output_bytes): honest results stay far within them.
RESULT_MAX_DEPTH = 64
RESULT_MAX_VALUES = 100_000


@contextlib.contextmanager
def _collector_paused():
    """Pause the garbage collector: the containers of a results document would each count towards a collection that
    walks the trainer's whole heap (0.60 s to parse 350k empty lists with torch imported, 0.08 s paused)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse_outputs(stdout: bytes, expected_count: int) -> list[CallOutput]:
    """The harness's results: exactly one well-formed document with one entry per call, within the bounds above and
    `MAX_SHARED_HASH`, checked before anything in it is hashed or compared. Raises ValueError with the reason."""
    malformed = "the harness output was missing or malformed (an early exit?)"
    decoder = PlainDecoder(RESULT_MAX_DEPTH, RESULT_MAX_VALUES, MAX_SHARED_HASH)
    # json.loads builds every container before the decoder counts them: count them first (a bracket inside a string
    # counts too, which only errs on the safe side).
    if stdout.count(b"[") + stdout.count(b"{") > RESULT_MAX_VALUES:
        raise ValueError(f"the call results are over a bound: more than {RESULT_MAX_VALUES} values")
    try:
        document = json.loads(stdout)
        entries = document["results"]
        if type(document) is not dict or len(document) != 1 or type(entries) is not list:
            raise ValueError(malformed)
        if len(entries) != expected_count:
            raise ValueError(malformed)
        outputs = []
        for entry in entries:
            if type(entry) is not dict or len(entry) != 1:
                raise ValueError(malformed)
            if "value" in entry:
                outputs.append(CallOutput(value=decoder.decode(entry["value"])))
            elif type(entry.get("error")) is str:
                outputs.append(CallOutput(error=entry["error"]))
            else:
                raise ValueError(malformed)
        return outputs
    except PlainBoundError as error:
        raise ValueError(f"the call results are over a bound: {error}") from None
    except RecursionError:  # json.loads met nesting deeper than the interpreter's recursion limit
        raise ValueError(f"the call results are over a bound: nested deeper than {RESULT_MAX_DEPTH} levels") from None
    except (ValueError, TypeError, KeyError):
        raise ValueError(malformed) from None
