"""Host memory: the peak a run reached (`trl_marl.memory.peak_memory`, which every recipe prints at the end), and the
free memory of every thread's allocator arena given back between phases (`trl_marl.memory.host`)."""

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


RESET = """
import json, os, torch
from trl_marl.memory.measured import reset_peak_resident, status_bytes

held = torch.ones(2**26, dtype=torch.float32)  # 256 MiB, touched
peak_holding = status_bytes("VmHWM")
del held  # a block this large is unmapped at once
floor = status_bytes("VmRSS", os.getpid())
reset_peak_resident()
print(json.dumps([peak_holding, floor, status_bytes("VmHWM")]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status (Linux)")
def test_resetting_the_peak_starts_it_again_from_the_resident_set_now():
    """What a benchmark reads between two training steps: the peak of what ran in between, not of the run so far."""
    result = subprocess.run([sys.executable, "-c", RESET], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    peak_holding, floor, peak_after_reset = json.loads(result.stdout)
    assert peak_holding - floor > 250 * 2**20  # the tensor was resident, then given back
    assert abs(peak_after_reset - floor) < 8 * 2**20


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


RELEASED = """
import json, threading
from trl_marl.memory.host import release_free_memory

def resident():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))

kept = []

def generate():  # as a serving engine's thread would: blocks below glibc's mmap threshold, in this thread's arena
    blocks = [bytearray(64 * 1024) for _ in range(4096)]  # 256 MiB
    kept.append(blocks[-1])  # the heap's last block stays in use: glibc cannot give the rest back by itself
    del blocks

worker = threading.Thread(target=generate)
worker.start()
worker.join()
before = resident()
released = release_free_memory()
print(json.dumps([before, resident(), released]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim (Linux)")
def test_what_another_thread_freed_goes_back_to_the_system():
    result = subprocess.run([sys.executable, "-c", RELEASED], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    before, after, released = json.loads(result.stdout)
    assert released and before - after > 200 * 2**20  # of the 256 MiB freed in the other thread's arena
