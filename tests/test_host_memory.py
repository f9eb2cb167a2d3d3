"""Measured memory: the peak a run reached (`trl_marl.memory.peak_memory`), as every recipe prints it at the end."""

import json
import subprocess
import sys

import pytest

from trl_marl.memory import PeakMemory, peak_memory
from trl_marl.memory.measured import GIB

HIGH_WATER = """
import json, torch
from trl_marl.memory import peak_resident_bytes

def high_water_mark():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))

before, before_kernel = peak_resident_bytes(), high_water_mark()
held = torch.ones(before // 4 + 2**24, dtype=torch.float32)  # 64 MiB more than the peak so far, touched
print(json.dumps([before, before_kernel, peak_resident_bytes(), high_water_mark(), held.numel() * 4]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_the_peak_resident_set_is_the_kernels_high_water_mark_and_follows_a_new_peak():
    """In a fresh process (a small peak), then after it touches a tensor larger than that peak."""
    result = subprocess.run([sys.executable, "-c", HIGH_WATER], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    before, before_kernel, after, after_kernel, held = json.loads(result.stdout)
    assert abs(before - before_kernel) < 4 * 2**20 and abs(after - after_kernel) < 4 * 2**20
    assert after >= held > before


def test_the_peak_is_described_per_device_in_gib():
    assert PeakMemory(int(5.25 * GIB)).describe() == "Peak memory: 5.25 GiB resident (CPU)"
    gpu = PeakMemory(2 * GIB, "cuda", int(10.5 * GIB), 11 * GIB)
    assert gpu.describe() == "Peak memory on cuda: 10.50 GiB allocated, 11.00 GiB reserved; host: 2.00 GiB resident"
    assert gpu.as_dict() == {
        "peak_resident_gib": 2.0,
        "device": "cuda",
        "peak_allocated_gib": 10.5,
        "peak_reserved_gib": 11.0,
    }
    on_this_machine = peak_memory()
    assert on_this_machine.resident > 0 and (on_this_machine.allocated is None) == (on_this_machine.device == "cpu")
