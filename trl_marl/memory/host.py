"""Host memory handed back to the system between the phases of a run.

glibc's `malloc` (Linux) keeps what a process frees in its arenas, one per thread that allocated (up to 8 per core),
and returns it to the system only from the top of each heap. A team's run allocates in several threads: the trainer's
(the loss), a serving engine's (generation behind an endpoint), its episodes' and tokenizers'. Each arena then keeps
the high-water mark of its own phase, so the resident set grows towards the sum of the phases' peaks rather than
their maximum, and creeps up step after step as freed blocks are reused in other sizes. `release_free_memory`
(`malloc_trim(0)`: every arena's free pages back to the system) at the end of each phase keeps the resident set at
the live memory. It is a no-op where the C library is not glibc; on a GPU it frees host memory only (torch's caching
allocator keeps device memory, as it should).
"""

import ctypes
import functools
import sys

from transformers import TrainerCallback


@functools.cache
def _malloc_trim():
    """glibc's `malloc_trim`, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's own C library, without `find_library`'s `ldconfig` run
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Give every arena's free pages back to the system (glibc `malloc_trim(0)`); whether any were released. Costs
    a few milliseconds per GiB of free heap; call it between phases, not per tensor."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class ReleaseFreeMemory(TrainerCallback):
    """After each optimizer step, what its forward and backward freed goes back to the system: the resident set between
    steps is the live memory (the team trainers add it)."""

    def on_step_end(self, args, state, control, **kwargs):
        release_free_memory()
