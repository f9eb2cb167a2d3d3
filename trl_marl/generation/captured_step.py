"""The parts of the captured decode step (`captured_decode.CapturedDecoder`) that hold its shapes fixed and record it:
the row and cache-length buckets every call is padded to (`bucket_rows`, `bucket_length`), the static buffers the step
reads (`StepBuffers`) and the attention mask it builds from them with no host sync and no branch on a value
(`step_attention_mask`), the sizes left symbolic for one compile (`mark_rows_and_length_dynamic`) and where the
compiled kernels are kept (`compile_cache_dir`), and on CUDA the recording by hand, in a memory pool every graph of a
decoder shares (`record_step`, `graph_pool`, `RecordedStep`).
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

# A batch is padded up to the next of these row counts (past the last, to a multiple of it), the cache up to a multiple
# of `CACHE_LENGTH_STEP` positions: each (rows, length) pair is one compiled graph.
ROW_BUCKETS = (8, 16, 32, 64, 128, 256)


CACHE_LENGTH_STEP = 256


def bucket_rows(rows: int) -> int:
    """The row count a batch of `rows` is padded to."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    return math.ceil(rows / ROW_BUCKETS[-1]) * ROW_BUCKETS[-1]


def bucket_length(positions: int) -> int:
    """The cache length a call needing `positions` positions (prompt and completion) gets."""
    return math.ceil(positions / CACHE_LENGTH_STEP) * CACHE_LENGTH_STEP


def compile_cache_dir() -> str:
    """Where the compiled step's kernels are kept between runs (inductor's on-disk caches): `TORCHINDUCTOR_CACHE_DIR`
    when it names a directory of the user's choice, else `trl_marl/torch_compile` under the user's cache directory
    (`$XDG_CACHE_HOME`, else `~/.cache`), not inductor's default in the temporary directory, which a reboot may empty.
    (Importing transformers' models sets the variable to that default: it counts as not chosen.)"""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return chosen
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "trl_marl", "torch_compile")


def mark_rows_and_length_dynamic(buffers: "StepBuffers", cache) -> None:
    """Let the compiled step serve every row bucket and cache length with one compile: the rows (and the cache
    length) of what it reads are symbolic sizes, not constants it is specialised on. Under CUDA graphs
    (`mode="reduce-overhead"`) each new shape is still recorded once, which costs a few steps, not a compile."""
    for tensor in (buffers.input_ids, buffers.position_ids):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    torch._dynamo.maybe_mark_dynamic(buffers.key_mask, (0, 1))
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.dim() == 4:  # (rows, heads, length, head size)
                torch._dynamo.maybe_mark_dynamic(tensor, (0, 2))


def step_attention_mask(
    key_mask: torch.Tensor, write_position: torch.Tensor, window: int | None, additive_dtype: torch.dtype | None
) -> torch.Tensor:
    """The 4-D attention mask of one decode step over the whole static cache, from tensors only (no host sync, no
    branch on a value: it is recorded into the step's graph).

    Args:
        key_mask: `(rows, cache length)` bool: the prompt's mask over its columns, True past them (generated tokens).
        write_position: 0-d long tensor, the cache position this step's token is written at (the query's position).
        window: a sliding window (a key `k` is seen by the query at `q` when `q - window < k`), or None.
        additive_dtype: None for a bool mask (True: attend; sdpa), else an additive mask of that dtype (0 or its
            minimum; eager attention adds it to the scores).
    Returns:
        `(rows, 1, 1, cache length)`: keys written so far (`k <= q`), within the window, not padding.
    """
    positions = torch.arange(key_mask.shape[1], device=key_mask.device)
    allowed = key_mask & (positions <= write_position)
    if window is not None:
        allowed = allowed & (positions > write_position - window)
    allowed = allowed[:, None, None, :]
    if additive_dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=additive_dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(additive_dtype).min
    )


def graph_pool(device: torch.device):
    """A new memory pool for a decoder's CUDA graphs to share (None off CUDA, where nothing is recorded)."""
    return torch.cuda.graph_pool_handle() if device.type == "cuda" else None


def record_step(step, restore, pool, warmup_steps: int = 2):
    """Record `step()` (no arguments: it reads static buffers only) as a CUDA graph; a callable that replays it and
    returns its output tensor (overwritten by the next replay).

    As CUDA graphs must be recorded: a few warm-up runs on a side stream first (kernels pick their algorithms and
    allocate their workspaces outside the graph), `restore()` after each (a step writes its token's keys and values
    and advances the cache's written length: the warm-ups must leave the cache as they found it), then one recording
    in the decoder's memory `pool`, shared by every graph it records until `release`. Recording runs no kernel."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup_steps):
            step()
            restore()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = step()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


@dataclass
class StepBuffers:
    """What a decode step reads, at fixed addresses for a (rows, cache length) shape: the token of each row, its
    position id, the cache position it is written at, and the key mask (`step_attention_mask`'s)."""

    input_ids: torch.Tensor  # (rows, 1)
    position_ids: torch.Tensor  # (rows, 1)
    cache_position: torch.Tensor  # (1,): the position this step's token is written at
    key_mask: torch.Tensor  # (rows, cache length) bool


@dataclass
class RecordedStep:
    """A recorded decode step: its replay, and the cache and routing buffers it was recorded on (how long recording
    took is in the decoder's `warmups` and `recordings`)."""

    replay: Callable[[], torch.Tensor]
    cache: Any
    routing_version: int
