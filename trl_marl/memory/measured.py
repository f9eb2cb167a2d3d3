"""Measured memory: the peak a run reached, as the recipes print it at the end (the planner predicts it beforehand).

On the CPU the peak is the process's resident set size (its high-water mark: every byte of host memory it held at
once, weights, activations and the allocator's free lists included). On an accelerator it is what torch's caching
allocator handed out (`torch.accelerator.max_memory_allocated`) and held (`max_memory_reserved`) at most, beside the
host's resident set.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass

import torch

GIB = 1024**3


@dataclass
class PeakMemory:
    """The peaks of one process, in bytes. `device` is `"cpu"` or the accelerator's type (`"cuda"`, ...); `allocated`
    and `reserved` are None on the CPU."""

    resident: int
    device: str = "cpu"
    allocated: int | None = None
    reserved: int | None = None

    def describe(self) -> str:
        """One line: `Peak memory: 5.3 GiB resident (CPU)`, or the accelerator's peaks and then the host's."""
        host = f"{self.resident / GIB:.2f} GiB resident"
        if self.allocated is None:
            return f"Peak memory: {host} (CPU)"
        return (
            f"Peak memory on {self.device}: {self.allocated / GIB:.2f} GiB allocated, {self.reserved / GIB:.2f} GiB "
            f"reserved; host: {host}"
        )

    def as_dict(self) -> dict[str, float | str | None]:
        """The peaks in GiB (for `results.json`)."""
        gib = {key: (value / GIB if isinstance(value, int) else value) for key, value in asdict(self).items()}
        return {f"peak_{key}_gib" if key != "device" else key: value for key, value in gib.items()}


def status_bytes(field: str, pid: int | str = "self") -> int:
    """A size from a process's `/proc/<pid>/status` (Linux), in bytes: `VmRSS` (its resident set now), `VmHWM` (the
    set's high-water mark), ..."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


def reset_peak_resident() -> None:
    """Start this process's high-water mark (`VmHWM`) again from its resident set now (Linux, `clear_refs` 5), so the
    next reading is the peak of what ran in between (benchmarks read one per training step)."""
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def peak_resident_bytes() -> int:
    """This process's peak resident set size so far: the kernel's high-water mark (`VmHWM`) on Linux, where
    `ru_maxrss` would start from the RSS of the process that forked it; `ru_maxrss` elsewhere (bytes on macOS)."""
    try:
        return status_bytes("VmHWM")
    except (OSError, StopIteration):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def peak_memory() -> PeakMemory:
    """The peaks of this process so far: host resident set, and torch's accelerator peaks when it used one."""
    resident = peak_resident_bytes()
    if not torch.accelerator.is_available():
        return PeakMemory(resident)
    accelerator = torch.accelerator.current_accelerator()
    return PeakMemory(
        resident,
        accelerator.type,
        torch.accelerator.max_memory_allocated(),
        torch.accelerator.max_memory_reserved(),
    )
