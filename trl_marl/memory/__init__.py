"""Memory planner: the peak memory of a team's training, predicted from configs before any weight loads.

`estimate_memory(config, model_config)` reads the architecture from a transformers `PretrainedConfig` (only
`config.json` is needed) and the team from a `MAGRPOConfig` / `ATGRPOConfig`, and returns a `MemoryEstimate`: every
component in bytes, and `peak = static + max(generation phase, training phase) + overhead`.

May import: every layer below it (the foundation, `sandbox`, `rollouts`, `tasks`, `generation`, `config`, `team`);
nothing above.

Notation: V vocabulary, h hidden size, I MLP intermediate size, L layers, n_h attention heads, n_kv key/value heads,
d head dimension, r LoRA rank, N adapters, P prompt tokens, C = `max_completion_length`, B training rows
(sequences) per micro-batch, S training sequence length, R rows of one `generate` call, P_t its prompt length. Byte
widths (`dtypes.byte_widths`): `b_m` the model dtype (the dtype of every weight that is not 4-bit: TRL loads float32
unless `model_init_kwargs={"dtype": ...}`), `b_a` the LoRA parameter dtype (float32; bfloat16 on a 4-bit base, where
TRL casts trainable adapters to bf16), `b_c` the autocast dtype (2 bytes with `bf16` / `fp16`).

One function per term, its formula in its docstring:

- static (`weights.py`): `base_weight_bytes` (`parameter_count` in `shape.py`, `nf4_bytes` on a 4-bit base),
  `adapter_bytes` (`lora_parameters` each), `optimizer_bytes` (`optimizer_state_bytes` per parameter);
- training phase (`training.py`): `gradient_bytes` (`weights.py`), `saved_activation_bytes` (one layer:
  `training_layer_bytes` = `layer_activation_bytes` + `routed_activation_bytes` + `autocast_weight_copy_bytes`), and
  the larger of `log_prob_head_bytes` and `backward_working_set_bytes`;
- generation phase (`generation.py`), for the largest `generate` call: `kv_cache_bytes`, `routed_lora_weight_bytes`,
  and the larger of `prefill_working_set_bytes` and `generation_logits_bytes`; with the captured decode step, the
  calls bucketed (`captured_call`), every row bucket's cache (`captured_kv_cache_bytes`) and, static,
  `captured_decode_bytes`;
- `overhead_bytes` (GPU only: the CUDA context and the allocator's slack), and `estimate_memory`, which sums them
  (`estimate.py`); for a team on several bases, `estimate_team_memory` (`bases.py`) estimates each base with its
  own architecture, precision and agents and sums them;
- with `use_vllm` (`vllm_engine.py`), no generation phase in the trainer: the colocated engine's pool
  `engine_pool_bytes` (a share of the card) holds its own `base_weight_bytes`, `lora_slot_bytes` (`vllm_lora_rank`),
  `engine_activation_bytes`, `ENGINE_NON_TORCH_BYTES` and what is left, its KV cache (`engine_kv_cache_bytes`,
  `kv_cache_tokens`), which must hold one `vllm_max_model_length` sequence (`sequence_kv_tokens`) and should hold the
  largest call, whose rows the team engine runs at once (`call_kv_tokens`, `vllm_max_num_seqs`); `card_problems` says
  what fails on a card.

The rows and lengths those terms see come from `rollout_geometry` (`geometry.py`).
"""

from ..generation.vllm_limits import VLLM_MAX_LORA_RANKS, vllm_lora_rank  # what vLLM serves, read by the planner
from .bases import PlannedBase, estimate_team_memory, planned_bases
from .dtypes import DTYPE_BYTES, ByteWidths, byte_widths, model_dtype_bytes
from .estimate import (
    ALLOCATOR_SLACK,
    CUDA_CONTEXT_BYTES,
    DEFAULT_PROMPT_LENGTH,
    GIB,
    MIB,
    MemoryEstimate,
    estimate_memory,
    overhead_bytes,
)
from .generation import (
    SAMPLING_BYTES_PER_ENTRY,
    SORT_BYTES_PER_ENTRY,
    GenerationTerms,
    captured_call,
    captured_decode_bytes,
    captured_kv_cache_bytes,
    generation_logits_bytes,
    generation_terms,
    kv_cache_bytes,
    largest_generation,
    prefill_working_set_bytes,
    routed_lora_weight_bytes,
)
from .geometry import GenerateCall, largest_call_rows, rollout_geometry, visible_answers, vllm_max_num_seqs
from .measured import PeakMemory, peak_memory, peak_resident_bytes
from .shape import (
    ATTENTION_LINEARS,
    MLP_LINEARS,
    SUPPORTED_MODEL_TYPES,
    ModelShape,
    layer_lora_parameters,
    lora_parameters,
    model_shape,
    parameter_count,
    targeted_linears,
)
from .training import (
    CPU_LOGPROB_BACKWARD_TILES,
    CPU_LOGPROB_FORWARD_TILES,
    LOGPROB_STATS_PER_TOKEN,
    LOGPROB_TOKEN_TILE,
    LOGPROB_VOCAB_TILE,
    autocast_weight_copy_bytes,
    backward_working_set_bytes,
    layer_activation_bytes,
    log_prob_head_bytes,
    routed_activation_bytes,
    saved_activation_bytes,
    training_layer_bytes,
)
from .vllm_engine import (
    ENGINE_BATCHED_TOKENS,
    ENGINE_NON_TORCH_BYTES,
    KV_BLOCK_TOKENS,
    EngineTerms,
    call_kv_tokens,
    card_problems,
    engine_activation_bytes,
    engine_kv_cache_bytes,
    engine_pool_bytes,
    engine_terms,
    kv_cache_tokens,
    lora_slot_bytes,
    sequence_kv_tokens,
)
from .weights import (
    FROZEN_ADAPTER_BYTES,
    NESTED_BLOCK,
    NF4_BLOCK,
    NF4_TENSOR_CONSTANT_BYTES,
    adapter_bytes,
    adapter_counts,
    base_weight_bytes,
    gradient_bytes,
    nf4_bytes,
    optimizer_bytes,
    optimizer_state_bytes,
)

__all__ = [
    "ALLOCATOR_SLACK",
    "PeakMemory",
    "peak_memory",
    "peak_resident_bytes",
    "ATTENTION_LINEARS",
    "ByteWidths",
    "CPU_LOGPROB_BACKWARD_TILES",
    "CPU_LOGPROB_FORWARD_TILES",
    "CUDA_CONTEXT_BYTES",
    "DEFAULT_PROMPT_LENGTH",
    "DTYPE_BYTES",
    "ENGINE_BATCHED_TOKENS",
    "ENGINE_NON_TORCH_BYTES",
    "EngineTerms",
    "FROZEN_ADAPTER_BYTES",
    "GIB",
    "GenerateCall",
    "GenerationTerms",
    "KV_BLOCK_TOKENS",
    "VLLM_MAX_LORA_RANKS",
    "LOGPROB_STATS_PER_TOKEN",
    "LOGPROB_TOKEN_TILE",
    "LOGPROB_VOCAB_TILE",
    "MIB",
    "MLP_LINEARS",
    "MemoryEstimate",
    "PlannedBase",
    "ModelShape",
    "NESTED_BLOCK",
    "NF4_BLOCK",
    "NF4_TENSOR_CONSTANT_BYTES",
    "SAMPLING_BYTES_PER_ENTRY",
    "SORT_BYTES_PER_ENTRY",
    "SUPPORTED_MODEL_TYPES",
    "adapter_bytes",
    "adapter_counts",
    "autocast_weight_copy_bytes",
    "backward_working_set_bytes",
    "base_weight_bytes",
    "byte_widths",
    "call_kv_tokens",
    "card_problems",
    "engine_activation_bytes",
    "engine_kv_cache_bytes",
    "engine_pool_bytes",
    "engine_terms",
    "estimate_memory",
    "estimate_team_memory",
    "generation_logits_bytes",
    "generation_terms",
    "gradient_bytes",
    "kv_cache_bytes",
    "kv_cache_tokens",
    "largest_call_rows",
    "largest_generation",
    "layer_activation_bytes",
    "layer_lora_parameters",
    "log_prob_head_bytes",
    "lora_parameters",
    "lora_slot_bytes",
    "model_dtype_bytes",
    "model_shape",
    "nf4_bytes",
    "optimizer_bytes",
    "optimizer_state_bytes",
    "overhead_bytes",
    "parameter_count",
    "planned_bases",
    "prefill_working_set_bytes",
    "rollout_geometry",
    "routed_activation_bytes",
    "routed_lora_weight_bytes",
    "saved_activation_bytes",
    "sequence_kv_tokens",
    "targeted_linears",
    "training_layer_bytes",
    "visible_answers",
    "vllm_lora_rank",
    "vllm_max_num_seqs",
    "captured_call",
    "captured_decode_bytes",
    "captured_kv_cache_bytes",
]
