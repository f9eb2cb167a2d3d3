"""What a sandboxed run may use ([`Limits`]) and what it returns ([`ExecutionResult`])."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run. Every limit is hard: the kernel or the parent enforces it, not the child.

    Memory is bounded per process (``RLIMIT_AS``), so one run can hold at most ``max_processes × memory_bytes``; with
    the defaults that is 16 × 512 MiB = 8 GiB in the worst case, times the pool's concurrency.
    """

    wall_time_s: float = 10.0  # monotonic deadline in the parent, then SIGKILL of the whole sandbox
    cpu_time_s: float | None = None  # RLIMIT_CPU; None: the wall time, rounded up
    memory_bytes: int = 512 * 2**20  # RLIMIT_AS, per process
    max_processes: int = 16  # RLIMIT_NPROC: processes and threads of the sandbox, the harness included
    scratch_bytes: int = 64 * 2**20  # size of the scratch tmpfs (bubblewrap) and RLIMIT_FSIZE (both backends)
    shm_bytes: int = 8 * 2**20  # size of /dev/shm (bubblewrap)
    tmpfs_inodes: int = 4096  # files, directories and links in /scratch, and separately in /dev/shm (bubblewrap)
    output_bytes: int = 1 * 2**20  # captured bytes of stdout, and separately of stderr; more kills the run
    max_open_files: int = 64  # RLIMIT_NOFILE

    def __post_init__(self):
        positive = ("wall_time_s", "memory_bytes", "max_processes", "scratch_bytes", "shm_bytes", "tmpfs_inodes")
        for name in (*positive, "output_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"Limits.{name} must be a positive number, got {value!r}.")
        if self.cpu_time_s is not None and not self.cpu_time_s > 0:
            raise ValueError(f"Limits.cpu_time_s must be positive or None, got {self.cpu_time_s!r}.")
        if self.max_processes < 3:
            raise ValueError(
                f"Limits.max_processes must be at least 3 (the harness and room for the code's own), got "
                f"{self.max_processes}."
            )
        if self.max_open_files < 16:
            raise ValueError(
                f"Limits.max_open_files must be at least 16 (Python needs a few), got {self.max_open_files}."
            )

    @property
    def cpu_seconds(self) -> int:
        return math.ceil(self.cpu_time_s if self.cpu_time_s is not None else self.wall_time_s)

    def rlimits(self) -> dict[str, int]:
        """The rlimits the harness sets (soft = hard) before the candidate's first line runs."""
        return {
            "RLIMIT_AS": int(self.memory_bytes),
            "RLIMIT_CPU": self.cpu_seconds,
            "RLIMIT_NPROC": int(self.max_processes),
            "RLIMIT_FSIZE": int(self.scratch_bytes),
            "RLIMIT_NOFILE": int(self.max_open_files),
            "RLIMIT_CORE": 0,
            "RLIMIT_SIGPENDING": 64,  # queued signals, and POSIX timers (each holds one): kernel memory otherwise
        }


class Status(str, enum.Enum):
    """How a run ended. Only ``ok`` can score; every other status scores 0."""

    OK = "ok"  # exited with status 0 (and, for function calls, printed well-formed results)
    TIMEOUT = "timeout"  # reached the wall deadline or the CPU-time limit
    MEMORY = "memory"  # ran out of its memory limit
    KILLED = "killed"  # died from a signal, or was killed for flooding its output
    ERROR = "error"  # exited with a non-zero status, or printed malformed results
    REFUSED = "refused"  # the sandbox could not be set up; nothing ran


@dataclass(frozen=True)
class CallOutput:
    """One function call's outcome: its plain return ``value``, or the ``error`` it raised (then ``value`` is None)."""

    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class ExecutionResult:
    """A finished run. ``stdout``/``stderr`` are what was captured (at most ``Limits.output_bytes`` each)."""

    status: Status
    backend: str
    returncode: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time_s: float = 0.0  # from start to the sandbox being reaped, in the parent
    reason: str = ""  # why the status is not ok, in words
    outputs: list[CallOutput] | None = field(default=None)  # function-call runs that ended ok

    @property
    def ok(self) -> bool:
        return self.status is Status.OK
