"""`Sandbox`: run model-written Python under hard limits, one sample or many at once under a global concurrency cap."""

from __future__ import annotations

import json
import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from .backends import make_backend
from .harness import MEMORY_EXIT_CODE, decode_plain, encode_plain
from .process import kill_all
from .result import CallOutput, ExecutionResult, Limits, Status
from .scoring import pass_rate


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
        results in order. For scoring that runs code in the sandbox and does more around it; on an interruption the
        sandbox's runs are killed and cleaned up before the exception propagates."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="trl-marl-sandbox")
        futures: list[Future] = [self._pool.submit(function, item) for item in items]
        try:
            return [future.result() for future in futures]
        except BaseException:
            # Interrupted (or a run failed to start): start nothing new, kill what runs, wait until each run has
            # reaped its processes and removed its files, then re-raise.
            # Killing repeatedly until every future is done also catches a run that a worker was starting while
            # the first kill went out (its process not yet registered), which would otherwise run to its deadline.
            for future in futures:
                future.cancel()
            while True:
                kill_all(owner=self)
                _, running = wait(futures, timeout=0.05)
                if not running:
                    break
            raise

    def close(self) -> None:
        """Kill this object's running sandboxes and stop its worker threads."""
        if self._pool is not None:
            kill_all(owner=self)
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
            outputs = _parse_outputs(finished.stdout, len(job["calls"]))
            if outputs is None:
                status, reason = Status.ERROR, "the harness output was missing or malformed (an early exit?)"
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


def _parse_outputs(stdout: bytes, expected_count: int) -> list[CallOutput] | None:
    """The harness's results, or None when they are not exactly one well-formed document with one entry per call."""
    try:
        document = json.loads(stdout)
        entries = document["results"]
        if type(document) is not dict or len(document) != 1 or type(entries) is not list:
            return None
        if len(entries) != expected_count:
            return None
        outputs = []
        for entry in entries:
            if type(entry) is not dict or len(entry) != 1:
                return None
            if "value" in entry:
                outputs.append(CallOutput(value=decode_plain(entry["value"])))
            elif type(entry.get("error")) is str:
                outputs.append(CallOutput(error=entry["error"]))
            else:
                return None
        return outputs
    except (ValueError, TypeError, KeyError, RecursionError):
        return None
