"""The generation phase: what the largest `generate` call of the rollout holds, R rows with prompts of P_t tokens
and C new tokens each.

`kv_cache_bytes` + `routed_lora_weight_bytes` + the larger of `prefill_working_set_bytes` and
`generation_logits_bytes` (`GenerationTerms.total`).

With the captured decode step (`trl_marl.generation.captured_decode`), each call's rows and length are rounded up to
their buckets (`captured_call`); its static caches, one per row bucket, live until the rollout ends
(`captured_kv_cache_bytes`, the generation phase's KV cache), and what the decoder holds for the whole run, the
router's copy of every adapter and the CUDA graphs' pool, is static memory (`captured_decode_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..generation.captured_step import bucket_length, bucket_rows
from .dtypes import ByteWidths
from .geometry import GenerateCall
from .shape import ModelShape, layer_lora_parameters

# `generate`'s last-token scores beyond the logits themselves, per vocabulary entry: an fp32 copy, the processed
# scores (temperature warper) and the softmax probabilities; top-p / top-k sampling sorts them too (fp32 values and
# int64 indices).
SAMPLING_BYTES_PER_ENTRY = 4 + 4 + 4
SORT_BYTES_PER_ENTRY = 4 + 8


def kv_cache_bytes(shape: ModelShape, rows: int, length: int, model_bytes: int) -> int:
    """The KV cache of R = `rows` sequences of `length` = P_t + C tokens: `2·L·n_kv·d·b_m·R·(P_t + C)`."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * model_bytes * rows * length


def routed_lora_weight_bytes(
    shape: ModelShape, targets: list[str], rank: int, adapters: int, adapter_width: int
) -> int:
    """With N = `adapters` > 1, the router concatenates the adapters along the rank once per `generate` call and
    keeps them for the call (no copy per row): `N·L·r·Σ_targeted(in + out)·b_a`; 0 with one adapter."""
    if adapters <= 1:
        return 0
    return adapters * shape.num_layers * layer_lora_parameters(shape, rank, targets) * adapter_width


def captured_call(call: GenerateCall, completion_length: int) -> GenerateCall:
    """The call as the captured decode step runs it: `bucket_rows(R)` rows, and a cache of
    `bucket_length(P_t + C)` positions (the prompt length made up to it; the prefill itself stays P_t long, which
    this overstates only for the prefill's working set)."""
    length = bucket_length(call.prompt_length + completion_length)
    return dataclasses.replace(call, rows=bucket_rows(call.rows), prompt_length=length - completion_length)


def captured_kv_cache_bytes(
    shape: ModelShape, calls: list[GenerateCall], completion_length: int, model_bytes: int
) -> int:
    """The captured decode step's static caches during a rollout, for `calls` as it runs them (`captured_call`): one
    per row bucket R_b, as long as the longest call of that bucket, kept until the rollout ends:
    `Σ_buckets kv_cache_bytes(R_b, max(P_t + C))`."""
    longest: dict[int, int] = {}
    for call in calls:
        longest[call.rows] = max(longest.get(call.rows, 0), call.prompt_length + completion_length)
    return sum(kv_cache_bytes(shape, rows, length, model_bytes) for rows, length in longest.items())


# The linears that read one input, whose LoRA matmuls the captured step groups (`tensor_routing.py`).
SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def captured_decode_bytes(
    shape: ModelShape, targets: list[str], rank: int, adapters: int, adapter_width: int, rows: int, model_bytes: int
) -> int:
    """What the captured decode step holds for the whole run: the router's copies of the adapters, and the graph pool
    of the one-token step for the largest bucket's R = `rows` rows, its logits and one layer's working set:
    `R·(V·b_m + 2·h·b_m + 4·h + 4·n_h·d·b_m + 3·I·b_m)`.

    The copies (`tensor_routing.py`): every adapter's A stacked and its B on the diagonal of its group's B (the layers
    reading one input, q/k/v and gate/up, share one: a layer's B columns are repeated `|G|` times, zeros off its
    block), once for the calls mixing agents and once for a call on one agent:
    `(N + [N > 1])·L·r·Σ_targeted(in + |G|·out)·b_a`."""
    linears = shape.linears()
    group_size = {name: len(set(group) & set(targets)) for group in SHARED_INPUTS for name in group}
    per_adapter = rank * sum(linears[name][0] + group_size.get(name, 1) * linears[name][1] for name in targets)
    copies = (adapters + (adapters > 1)) * shape.num_layers * per_adapter * adapter_width
    h, heads_dim = shape.hidden_size, shape.num_heads * shape.head_dim
    layer = 2 * h * model_bytes + 4 * h + 4 * heads_dim * model_bytes + 3 * shape.intermediate_size * model_bytes
    return copies + rows * (shape.vocab_size * model_bytes + layer)


def prefill_working_set_bytes(shape: ModelShape, rows: int, prompt_length: int, model_bytes: int) -> int:
    """One layer of the prefill forward (no grad) over R·P_t tokens, and its attention mask:
    `R·P_t·(2·h·b_m + 4·h + 4·n_h·d·b_m + 3·I·b_m) + R·P_t²·(b_m + 1)` (the mask as bool and as a float bias)."""
    h = shape.hidden_size
    heads_dim = shape.num_heads * shape.head_dim
    per_token = 2 * h * model_bytes + 4 * h + 4 * heads_dim * model_bytes + 3 * shape.intermediate_size * model_bytes
    return rows * prompt_length * per_token + rows * prompt_length**2 * (model_bytes + 1)


def generation_logits_bytes(shape: ModelShape, rows: int, model_bytes: int, sorted_sampling: bool) -> int:
    """The last-token logits and `generate`'s sampling buffers: `R·V·(b_m + 12)`, `+ 12` per entry when top-p /
    top-k sampling sorts them (`sorted_sampling`)."""
    sort = SORT_BYTES_PER_ENTRY if sorted_sampling else 0
    return rows * shape.vocab_size * (model_bytes + SAMPLING_BYTES_PER_ENTRY + sort)


class GenerationTerms(NamedTuple):
    """The generation phase's terms of one `generate` call, in bytes (named as `MemoryEstimate`'s fields)."""

    kv_cache: int
    routed_lora_weights: int
    prefill_working_set: int
    generation_logits: int

    @property
    def total(self) -> int:
        """`kv_cache + routed_lora_weights + max(prefill_working_set, generation_logits)`."""
        return self.kv_cache + self.routed_lora_weights + max(self.prefill_working_set, self.generation_logits)


def generation_terms(
    shape: ModelShape,
    call: GenerateCall,
    completion_length: int,
    dtypes: ByteWidths,
    targets: list[str],
    rank: int,
    adapters: int,
    sorted_sampling: bool,
) -> GenerationTerms:
    """The terms of one `generate` call of `call.rows` rows, `call.prompt_length` prompt tokens and
    `completion_length` new tokens each."""
    return GenerationTerms(
        kv_cache=kv_cache_bytes(shape, call.rows, call.prompt_length + completion_length, dtypes.model),
        routed_lora_weights=routed_lora_weight_bytes(shape, targets, rank, adapters, dtypes.adapter),
        prefill_working_set=prefill_working_set_bytes(shape, call.rows, call.prompt_length, dtypes.model),
        generation_logits=generation_logits_bytes(shape, call.rows, dtypes.model, sorted_sampling),
    )


def largest_generation(
    shape: ModelShape,
    calls: list[GenerateCall],
    completion_length: int,
    dtypes: ByteWidths,
    targets: list[str],
    rank: int,
    adapters: int,
    sorted_sampling: bool,
) -> GenerationTerms:
    """The terms of the call with the largest `GenerationTerms.total` (the first of equals)."""
    terms = (
        generation_terms(shape, call, completion_length, dtypes, targets, rank, adapters, sorted_sampling)
        for call in calls
    )
    return max(terms, key=lambda call_terms: call_terms.total)
