"""The colocated vLLM engine (`use_vllm=True`, docs/vllm.md): what it holds on the card beside the trainer.

At start vLLM reserves `vllm_gpu_memory_utilization` of the card's *total* memory, its pool (`engine_pool_bytes`), and
refuses to start when that much is not free. Inside the pool: its own copy of the base weights (`base_weight_bytes`,
unquantized in the model dtype: vLLM 0.31 has no bitsandbytes quantization, so a 4-bit trainer base is refused), the
LoRA slots it preallocates at a rank vLLM serves (`lora_slot_bytes`, `vllm_lora_rank`), the peak of its profiling
forward (`engine_activation_bytes`) and its memory outside torch (`ENGINE_NON_TORCH_BYTES`); what is left is the KV
cache (`engine_kv_cache_bytes`), in blocks of `KV_BLOCK_TOKENS` tokens (`kv_cache_tokens`). The KV cache must hold one
`vllm_max_model_length` sequence, or vLLM refuses to start; it should hold every row of the largest generation call,
which the team engine runs at once (its `max_num_seqs` is at least that call's rows: `geometry.vllm_max_num_seqs`), or
vLLM queues rows (slower, not an error; `call_kv_tokens`). `card_problems` says which of these fail on a card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..generation.vllm_limits import vllm_lora_rank
from .generation import generation_logits_bytes, kv_cache_bytes
from .geometry import GenerateCall
from .shape import ModelShape, lora_parameters

# TRL 1.16's colocated engine (`VLLMGeneration._init_vllm`) passes `max_num_batched_tokens=4096`: the tokens of
# vLLM's profiling forward, and the most tokens one engine step runs.
ENGINE_BATCHED_TOKENS = 4096
# vLLM's KV cache is paged in blocks of 16 tokens on CUDA (its default `block_size`).
KV_BLOCK_TOKENS = 16
# What vLLM's profiling counts outside torch's allocator in the pool ("non-torch forward increase memory": cuBLAS and
# attention-backend workspaces, communicator buffers). vLLM logs 0.05-0.2 GiB for one GPU; an allowance, not measured.
ENGINE_NON_TORCH_BYTES = 256 * 2**20


def engine_pool_bytes(gpu_memory_bytes: int, utilization: float) -> int:
    """vLLM's pool on a card of M = `gpu_memory_bytes`: `U · M`, U = `vllm_gpu_memory_utilization`, a share of the
    card's total memory (not of what is free). vLLM refuses to start when less than `U · M` is free."""
    return int(utilization * gpu_memory_bytes)


def lora_slot_bytes(shape: ModelShape, max_loras: int, max_lora_rank: int, model_bytes: int) -> int:
    """The LoRA slots vLLM preallocates with `enable_lora`: `max_loras · L · Σ r_max·(in + out) · b_m` over every
    linear of a decoder layer (`lora_parameters` at `max_lora_rank`), in the model dtype (vLLM's `lora_dtype="auto"`).
    r_max is the rank vLLM is given, `vllm_lora_rank(lora_r)` (16 for r = 16, 8 for r = 4).

    vLLM wraps every linear layer (q/k/v, o, gate/up, down), whatever the adapters target.
    """
    return max_loras * lora_parameters(shape, max_lora_rank, "all-linear") * model_bytes


def engine_activation_bytes(
    shape: ModelShape,
    batched_tokens: int,
    max_num_seqs: int,
    model_bytes: int,
    max_lora_rank: int,
    load_in_4bit: bool,
) -> int:
    """The peak of vLLM's profiling run, which vLLM takes out of the pool before it sizes the KV cache. This is an
    approximation (one layer's largest live set), not vLLM's measurement.

    The forward over T = `batched_tokens` tokens (4096 with TRL) holds the residual stream and the hidden states
    `2·T·h·b_m` and the larger block's outputs: attention `T·(2·n_h + 2·n_kv)·d·b_m` (fused q/k/v and the attention
    output) or MLP `3·T·I·b_m` (fused gate/up and the SiLU product); plus Punica's fp32 LoRA buffer `3·T·r_max·4` (the
    three slices of q/k/v) and, on a 4-bit base (a vLLM with bitsandbytes, before 0.31; the planner passes False, as
    trl_marl's engine serves the base unquantized), the weight shard bitsandbytes dequantizes for one matmul
    `max(in·out)·b_m`. The sampler then runs on R = min(`max_num_seqs`, T) rows beside the hidden states `T·h·b_m`:
    `generation_logits_bytes` with sorting (vLLM's dummy sampler applies top-p and top-k). The peak is the larger.
    In the team engine `max_num_seqs` is the largest call's rows (`geometry.vllm_max_num_seqs`).
    """
    tokens, heads_dim = batched_tokens, shape.head_dim
    attention = (2 * shape.num_heads + 2 * shape.num_kv_heads) * heads_dim
    forward = tokens * (2 * shape.hidden_size + max(attention, 3 * shape.intermediate_size)) * model_bytes
    forward += 3 * tokens * max_lora_rank * 4
    if load_in_4bit:
        forward += max(fan_in * fan_out for fan_in, fan_out in shape.linears().values()) * model_bytes
    rows = min(max_num_seqs, tokens)
    sampler = tokens * shape.hidden_size * model_bytes + generation_logits_bytes(shape, rows, model_bytes, True)
    return max(forward, sampler)


def engine_kv_cache_bytes(pool: int, weights: int, lora_slots: int, activations: int, non_torch: int) -> int:
    """The KV cache vLLM is left with: `pool − weights − LoRA slots − activation peak − non-torch memory` (negative
    when the pool cannot even hold the rest)."""
    return pool - weights - lora_slots - activations - non_torch


def kv_cache_tokens(kv_bytes: int, token_bytes: int) -> int:
    """The tokens a KV cache of `kv_bytes` holds: whole blocks of 16 tokens, `⌊kv / (16·t)⌋·16`, t = `token_bytes`
    (`kv_cache_bytes` of one token, `2·L·n_kv·d·b_m`); 0 when `kv_bytes` ≤ 0."""
    return max(kv_bytes, 0) // (KV_BLOCK_TOKENS * token_bytes) * KV_BLOCK_TOKENS


def sequence_kv_tokens(length: int) -> int:
    """The KV cache tokens one sequence of `length` tokens takes: whole blocks, `⌈length / 16⌉·16`."""
    return math.ceil(length / KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS


def call_kv_tokens(call: GenerateCall, completion_length: int, max_num_seqs: int) -> int:
    """The KV cache tokens of the rows of a `generate` call that vLLM runs at once: `min(R, max_num_seqs) ·
    ⌈(P_t + C) / 16⌉·16`; rows beyond `max_num_seqs` wait for a free sequence slot whatever the KV cache. The team
    engine (`TeamVLLMGeneration`) sets `max_num_seqs = max(TRL's per_device_train_batch_size · steps_per_generation ·
    vllm_tensor_parallel_size, the largest call's rows · vllm_tensor_parallel_size)` (`geometry.vllm_max_num_seqs`),
    so every call runs all its R rows at once: `R · ⌈(P_t + C) / 16⌉·16`. An upper bound: vLLM's prefix caching
    shares the blocks of identical prompts (the G copies of a prompt)."""
    return min(call.rows, max_num_seqs) * sequence_kv_tokens(call.prompt_length + completion_length)


@dataclass(frozen=True)
class EngineTerms:
    """The engine's terms that do not depend on the card, in bytes, and what its KV cache must hold, in tokens.

    `weights`, `lora_slots`, `activations`, `non_torch`: the pool's parts besides the KV cache (`fixed`);
    `kv_token_bytes`: one token's KV cache; `max_model_len`: vLLM's context (`vllm_max_model_length`, else the model's
    `max_position_embeddings`); `call_tokens`: `call_kv_tokens` of the largest call, described by `call`;
    `max_num_seqs`: the rows vLLM runs at once (the team engine's, `geometry.vllm_max_num_seqs`).
    """

    utilization: float
    weights: int
    lora_slots: int
    activations: int
    non_torch: int
    kv_token_bytes: int
    max_model_len: int
    max_model_len_is_models: bool  # `vllm_max_model_length` unset: vLLM takes the model's context
    call_tokens: int
    call: str
    max_num_seqs: int
    max_loras: int
    max_lora_rank: int
    sleep_mode: bool
    four_bit_trainer: bool = False  # the trainer's base is 4-bit: the engine refuses it (`card_problems`)

    @property
    def fixed(self) -> int:
        """The pool's parts besides the KV cache."""
        return self.weights + self.lora_slots + self.activations + self.non_torch

    def pool(self, gpu_memory_bytes: int) -> int:
        return engine_pool_bytes(gpu_memory_bytes, self.utilization)

    def kv_cache(self, gpu_memory_bytes: int) -> int:
        return engine_kv_cache_bytes(
            self.pool(gpu_memory_bytes), self.weights, self.lora_slots, self.activations, self.non_torch
        )

    def kv_tokens(self, gpu_memory_bytes: int) -> int:
        return kv_cache_tokens(self.kv_cache(gpu_memory_bytes), self.kv_token_bytes)

    def needed_tokens(self) -> int:
        """What the KV cache should hold: one `max_model_len` sequence and the largest call's concurrent rows."""
        return max(sequence_kv_tokens(self.max_model_len), self.call_tokens)

    def minimum_utilization(self, gpu_memory_bytes: int, step: float = 0.01) -> float:
        """The smallest `vllm_gpu_memory_utilization`, a multiple of `step`, whose KV cache holds `needed_tokens` on a
        card of `gpu_memory_bytes`: `⌈(fixed + needed · t) / M / step⌉ · step`."""
        needed = self.fixed + self.needed_tokens() * self.kv_token_bytes
        return round(math.ceil(needed / gpu_memory_bytes / step - 1e-9) * step, 6)

    def rows(self) -> list[tuple[str, int]]:
        """`(name, bytes)` of the pool's parts besides the KV cache, for `MemoryEstimate.table`."""
        return [
            ("vLLM: base weights (its own copy)", self.weights),
            (f"vLLM: LoRA slots ({self.max_loras} x r={self.max_lora_rank}, every linear)", self.lora_slots),
            (f"vLLM: profiling activation peak ({ENGINE_BATCHED_TOKENS} tokens)", self.activations),
            ("vLLM: non-torch memory (allowance)", self.non_torch),
            ("= vLLM pool without its KV cache", self.fixed),
        ]

    def describe(self) -> str:
        """The pool and what its KV cache must hold, in words (the pool itself depends on the card)."""
        held = "while it generates (sleep mode)" if self.sleep_mode else "for the whole run"
        default = " (the model's: set vllm_max_model_length)" if self.max_model_len_is_models else ""
        return (
            f"vLLM pool = vllm_gpu_memory_utilization={self.utilization:g} x the card, beside the trainer {held}; its "
            f"KV cache ({self.kv_token_bytes:,} bytes a token) must hold one vllm_max_model_length sequence "
            f"({self.max_model_len:,} tokens{default}) and should hold the largest call's {self.call_tokens:,} tokens "
            f"({self.call}, max_num_seqs={self.max_num_seqs})"
        )


def engine_terms(
    shape: ModelShape,
    *,
    utilization: float,
    weights: int,
    model_bytes: int,
    load_in_4bit: bool,
    max_loras: int,
    max_lora_rank: int,
    max_model_len: int | None,
    model_max_len: int,
    calls: list[GenerateCall],
    completion_length: int,
    max_num_seqs: int,
    sleep_mode: bool,
) -> EngineTerms:
    """The engine's card-independent terms for a rollout of `calls` (`rollout_geometry`); `weights` is the base's
    unquantized `base_weight_bytes` (vLLM loads the same checkpoint in the model dtype). `load_in_4bit`: the trainer's
    base is 4-bit, which trl_marl's engine refuses (vLLM 0.31 has no bitsandbytes): `card_problems` says so on every
    card. `max_lora_rank`: `lora_r`, served at `vllm_lora_rank(lora_r)`. `max_model_len` None: vLLM takes
    `model_max_len` (the model's `max_position_embeddings`). `max_num_seqs`: the engine's,
    `geometry.vllm_max_num_seqs(config)` (at least the largest call's rows)."""
    largest = max(calls, key=lambda call: call_kv_tokens(call, completion_length, max_num_seqs))
    max_lora_rank = vllm_lora_rank(max_lora_rank)
    return EngineTerms(
        utilization=utilization,
        weights=weights,
        lora_slots=lora_slot_bytes(shape, max_loras, max_lora_rank, model_bytes),
        activations=engine_activation_bytes(
            shape, ENGINE_BATCHED_TOKENS, max_num_seqs, model_bytes, max_lora_rank, load_in_4bit=False
        ),
        non_torch=ENGINE_NON_TORCH_BYTES,
        kv_token_bytes=kv_cache_bytes(shape, 1, 1, model_bytes),
        max_model_len=max_model_len or model_max_len,
        max_model_len_is_models=max_model_len is None,
        call_tokens=call_kv_tokens(largest, completion_length, max_num_seqs),
        call=f"{min(largest.rows, max_num_seqs)} of {largest.rows} rows x {largest.prompt_length + completion_length}",
        max_num_seqs=max_num_seqs,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank,
        sleep_mode=sleep_mode,
        four_bit_trainer=load_in_4bit,
    )


def card_problems(
    engine: EngineTerms, gpu_memory_bytes: int, trainer_at_start: int, trainer_peak: int, process_peak: int
) -> tuple[list[str], list[str]]:
    """`(failures, warnings)` of the engine beside the trainer on a card of M = `gpu_memory_bytes`, in words.

    Failures: trl_marl refuses a 4-bit trainer base with vLLM (`load_in_4bit`: vLLM 0.31 cannot serve it); vLLM
    refuses to start when `trainer_at_start` (what the trainer holds when the engine starts: CUDA
    context, base weights, adapters) leaves less than the pool free, when the pool has no room for a KV cache, or when
    the KV cache cannot hold one `max_model_len` sequence; the run runs out of memory when `process_peak` (the
    trainer, whose own peak is `trainer_peak`, with the pool beside it) exceeds M. Warning: the KV cache holds fewer
    tokens than the largest call's concurrent rows, so vLLM queues rows.
    """
    gib, pool = 2**30, engine.pool(gpu_memory_bytes)
    kv, tokens = engine.kv_cache(gpu_memory_bytes), engine.kv_tokens(gpu_memory_bytes)
    raise_it = (
        f"raise vllm_gpu_memory_utilization (now {engine.utilization:g}; the smallest that holds "
        f"{engine.needed_tokens():,} tokens on this card is {engine.minimum_utilization(gpu_memory_bytes):g})"
    )
    failures, warnings = [], []
    if engine.four_bit_trainer:
        failures.append(
            "vLLM cannot serve a 4-bit base (`load_in_4bit`: vLLM 0.31 has no bitsandbytes quantization) and trl_marl "
            "refuses `use_vllm` with one: load the base unquantized (`--load_in_4bit false`, in the model dtype), as "
            "predicted here for vLLM's copy, or keep the 4-bit base without vLLM"
        )
    if gpu_memory_bytes - trainer_at_start < pool:
        failures.append(
            f"vLLM refuses to start: the trainer holds {trainer_at_start / gib:.1f} GiB when the engine starts, which "
            f"leaves {(gpu_memory_bytes - trainer_at_start) / gib:.1f} GiB free, less than the pool "
            f"(vllm_gpu_memory_utilization={engine.utilization:g} x {gpu_memory_bytes / gib:g} GiB = {pool / gib:.1f} "
            "GiB)"
        )
    if kv <= 0:
        failures.append(
            f"vLLM refuses to start: its pool ({pool / gib:.1f} GiB) is smaller than its weights, LoRA slots, "
            f"activations and non-torch memory ({engine.fixed / gib:.1f} GiB), leaving no KV cache; {raise_it}"
        )
    elif tokens < sequence_kv_tokens(engine.max_model_len):
        default = ", the model's" if engine.max_model_len_is_models else ""
        failures.append(
            f"vLLM refuses to start: the KV cache left in the pool ({kv / gib:.2f} GiB, {tokens:,} tokens) cannot "
            f"hold one vllm_max_model_length sequence ({engine.max_model_len:,} tokens{default}); {raise_it}, or "
            "lower vllm_max_model_length to the longest prompt + completion"
        )
    if process_peak > gpu_memory_bytes:
        if engine.sleep_mode:
            how = f"peaks at {process_peak / gib:.1f} GiB (the trainer's {trainer_peak / gib:.1f} GiB while it "
            how += f"trains; its weights and optimizer states beside the {pool / gib:.1f} GiB pool as vLLM generates)"
        else:
            how = f"needs {process_peak / gib:.1f} GiB: the trainer's peak ({trainer_peak / gib:.1f} GiB) beside "
            how += f"vLLM's pool ({pool / gib:.1f} GiB) for the whole run"
        failures.append(f"out of memory: the process {how}, over the card's {gpu_memory_bytes / gib:g} GiB")
    if 0 < tokens < engine.call_tokens:
        warnings.append(
            f"the KV cache holds {tokens:,} tokens, fewer than the {engine.call_tokens:,} of the largest call's rows "
            f"that run at once ({engine.call}): vLLM queues rows (slower, not an error; an upper bound, as prefix "
            "caching shares the blocks of a prompt's copies)"
        )
    return failures, warnings
