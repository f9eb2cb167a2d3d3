"""Memory planner: the peak memory of a team's training, predicted from configs before any weight loads.

`estimate_memory(config, model_config)` reads the architecture from a transformers `PretrainedConfig` (only
`config.json` is needed) and the team from a `MAGRPOConfig` / `ATGRPOConfig`, and returns a `MemoryEstimate`: every
component in bytes, and `peak = static + max(generation phase, training phase) + overhead`.

Notation: V vocabulary, h hidden size, I MLP intermediate size, L layers, n_h attention heads, n_kv key/value heads,
d head dimension, r LoRA rank, P prompt tokens, C = `max_completion_length`, B training rows (sequences) per
micro-batch, S training sequence length, R rows of one `generate` call. Byte widths: `b_m` the model dtype (the
dtype of every weight that is not 4-bit: TRL loads float32 unless `model_init_kwargs={"dtype": ...}`), `b_a` the
LoRA parameter dtype (float32; bfloat16 on a 4-bit base, where TRL casts trainable adapters to bf16), `b_c` the
autocast dtype (2 bytes with `bf16` / `fp16`).

- **Base weights.** Parameters per layer: attention `h·n_h·d + 2·h·n_kv·d + n_h·d·h` (+ biases), MLP `3·h·I`,
  norms `2·h` (+ `2·d` for Qwen3's q/k norms); plus embeddings `V·h`, the final norm `h`, and an untied lm_head
  `V·h`. In 4-bit NF4 (bitsandbytes, double quantization, blocks of 64) a decoder linear weight of n elements
  takes `n/2 + n/64 + 4·⌈n/16384⌉ + 1092` bytes (packed 4-bit values, uint8 absmax per block, fp32 absmax per 256
  blocks, the code tables and offset); embeddings, lm_head, norms and biases stay in `b_m`.
- **Adapters.** A targeted linear (in → out) carries `r·(in + out)` LoRA parameters; `"all-linear"` targets every
  decoder linear (PEFT leaves out lm_head). One adapter per agent (`per_agent`) or one in all (`shared`), `b_a` each.
- **Gradients and optimizer.** Trainable adapters only: gradients `b_a` per parameter; AdamW keeps two states in
  the parameter's dtype (`2·b_a`; 8-bit optimizers about 2 bytes, `*_32bit` 8 bytes). States persist from the first
  step, so they count in both phases; gradients are freed by `zero_grad` before the next generation.
- **Training activations** (one micro-batch, B·S tokens; `layer_activation_bytes`): what autograd saves per layer
  and token — RMSNorm inputs upcast to fp32 `2·4·h`, SDPA's q and the repeated k, v and its output `4·n_h·d`
  (transformers repeats the k/v heads whenever a padding mask is passed), the float attention mask `S` per token,
  the MLP's gate, up and SiLU outputs `3·I` (+ the product `I` when down_proj carries LoRA), LoRA inputs and
  outputs (`r` per targeted linear). Without gradient checkpointing all L layers are kept; with it, each layer's
  input `h·b_m` is kept and one layer is recomputed at a time. Plus the backward's working set (one layer's
  activations again and the residual gradients) and the log-prob head (TRL's fused lm-head, `log_prob_head_bytes`).
  With several adapters, the router concatenates the adapters along the rank, `N·r·Σ(in + out)` per layer, and keeps
  every agent's rank-space projection of every token and its masked copy, `2·N·r` per targeted linear and token.
- **Generation** (the largest `generate` call: R rows, prompt P_t): KV cache `2·L·n_kv·d·b_m·R·(P_t + C)`, the
  router's concatenated LoRA weights `N·L·r·Σ(in + out)·b_a` (kept for the whole call), the prefill's working set of
  one layer and the last-token logits with sampling buffers `R·V·(b_m + 12)` (+ `12` when top-p / top-k sort them).
- **Overhead** (GPU only): `CUDA_CONTEXT_BYTES` plus `ALLOCATOR_SLACK` of the dynamic memory.

Rows come from the rollout: MAGRPO turn t (0-based) has `copies·K^t` nodes' worth of rows per acting agent, with
K = G (aligned) or G^N (cross) and `copies = per_device_train_batch_size · steps_per_generation`; AT-GRPO has
`copies` rows per agent step. A micro-batch is the rows of a generation batch divided by `steps_per_generation`.
Prompts at later turns carry the earlier answers: P_t = P + (answers visible before it)·C — every earlier answer of
the episode, or under `debate` the other agents' previous answers — an upper bound that ignores a transition's own
feedback text (raise `prompt_length` to cover it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from .config import MAGRPOConfig

__all__ = ["MemoryEstimate", "ModelShape", "estimate_memory", "lora_parameters", "model_shape", "parameter_count"]

GIB = 2**30
MIB = 2**20
DEFAULT_PROMPT_LENGTH = 512

# bitsandbytes NF4: 64 weights per absmax block; with double quantization the absmaxes are uint8 in blocks of 256 with
# an fp32 absmax each; a quantized tensor also holds a 16-entry fp32 NF4 code, a 256-entry fp32 code for the absmaxes
# and an fp32 offset (read from bitsandbytes 0.50's QuantState).
NF4_BLOCK = 64
NESTED_BLOCK = 256
NF4_TENSOR_CONSTANT_BYTES = 16 * 4 + 256 * 4 + 4
# TRL 1.16's fused lm-head (`trl.kernels.chunked_logprob`): tiles of at most 4096 tokens x 32768 vocabulary entries.
LOGPROB_TOKEN_TILE = 4096
LOGPROB_VOCAB_TILE = 32768
# Without Triton (CPU) the tile math runs in torch, in float32. Live tiles counted in `_forward_tile`: the matmul
# buffer, the scaled logits, exp(z - max) and exp·z (entropy). In `_backward_tile`: the buffer, y, z, log p, p, the
# gradient, is_target (bool, a quarter) and the float is_target and its difference with p.
CPU_LOGPROB_FORWARD_TILES = 4
CPU_LOGPROB_BACKWARD_TILES = 8.25
# Per-token fp32 statistics of the fused head's forward (running max, sums, targets, ...).
LOGPROB_STATS_PER_TOKEN = 7 * 4
# `generate`'s last-token scores beyond the logits themselves, per vocabulary entry: an fp32 copy, the processed
# scores (temperature warper) and the softmax probabilities; top-p / top-k sampling sorts them too (fp32 values and
# int64 indices).
SAMPLING_BYTES_PER_ENTRY = 4 + 4 + 4
SORT_BYTES_PER_ENTRY = 4 + 8
# A GPU process holds the CUDA context (torch 2.x with lazy module loading, cuBLAS handles and workspaces: typically
# 300-600 MiB as nvidia-smi reports it) and the caching allocator reserves more than is allocated (block rounding,
# fragmentation). Neither exists on the CPU.
CUDA_CONTEXT_BYTES = 512 * MIB
ALLOCATOR_SLACK = 0.10
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# Decoder families whose layers are Llama-shaped (RMSNorm, GQA attention, SwiGLU MLP): how their biases are laid out.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a Llama-shaped decoder, read from its config (see `model_shape`)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    bias: dict[str, bool]  # linear name -> has a bias
    qk_norm: bool  # Qwen3: RMSNorm over the head dimension of q and k

    def linears(self) -> dict[str, tuple[int, int]]:
        """`name -> (in_features, out_features)` of the linear layers of one decoder layer."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.num_heads * self.head_dim, self.num_kv_heads
        kv = kv * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def layer_weight_elements(self) -> int:
        """Elements of one layer's linear weights (what 4-bit quantizes): Σ in·out."""
        return sum(fan_in * fan_out for fan_in, fan_out in self.linears().values())

    def layer_other_elements(self) -> int:
        """Elements of one layer that stay unquantized: biases, the two RMSNorms, Qwen3's q/k norms."""
        biases = sum(fan_out for name, (_, fan_out) in self.linears().items() if self.bias[name])
        return biases + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def embedding_elements(self) -> int:
        """Embeddings `V·h`, plus the lm_head `V·h` unless tied, plus the final norm `h`."""
        heads = 1 if self.tie_word_embeddings else 2
        return heads * self.vocab_size * self.hidden_size + self.hidden_size


def model_shape(model_config: PretrainedConfig) -> ModelShape:
    """The `ModelShape` of a transformers config of a supported decoder family (`SUPPORTED_MODEL_TYPES`).

    Raises `ValueError` for other architectures (mixture-of-experts, encoder-decoder, multimodal, ...), naming it.
    """
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES or getattr(config, "num_local_experts", None):
        raise ValueError(
            f"The memory planner knows Llama-shaped decoders ({', '.join(SUPPORTED_MODEL_TYPES)}), not "
            f"model_type={model_type!r}: its parameter and activation counts would be guesses."
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if model_type == "qwen2":  # q, k and v carry biases, o does not
        bias = {name: name in ("q_proj", "k_proj", "v_proj") for name in (*ATTENTION_LINEARS, *MLP_LINEARS)}
    else:
        attention_bias = bool(getattr(config, "attention_bias", False))
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        bias = {name: attention_bias for name in ATTENTION_LINEARS} | {name: mlp_bias for name in MLP_LINEARS}
    return ModelShape(
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        tie_word_embeddings=bool(getattr(model_config, "tie_word_embeddings", True)),
        bias=bias,
        qk_norm=model_type == "qwen3",
    )


def parameter_count(shape: ModelShape) -> int:
    """All parameters: `L·(Σ in·out + biases + norms) + V·h·(1 or 2) + h`."""
    layer = shape.layer_weight_elements() + shape.layer_other_elements()
    return shape.num_layers * layer + shape.embedding_elements()


def targeted_linears(shape: ModelShape, target_modules: list[str] | str) -> list[str]:
    """The linear names of a layer that carry LoRA: all of them for `"all-linear"`, else those named.

    Raises `ValueError` naming a target that is no linear of the architecture.
    """
    targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if targets == ["all-linear"]:
        return list(shape.linears())
    unknown = [name for name in targets if name not in shape.linears()]
    if unknown:
        raise ValueError(
            f"`lora_target_modules` {unknown} are not linear layers the planner knows; use 'all-linear' or names "
            f"among {list(shape.linears())}."
        )
    return [name for name in shape.linears() if name in targets]


def lora_parameters(shape: ModelShape, rank: int, target_modules: list[str] | str) -> int:
    """Parameters of one LoRA adapter: `L · Σ_targeted r·(in + out)`."""
    linears = shape.linears()
    return shape.num_layers * sum(rank * sum(linears[name]) for name in targeted_linears(shape, target_modules))


def nf4_bytes(elements: int) -> int:
    """Bytes of one weight of `elements` values in NF4 with double quantization (see `NF4_BLOCK`)."""
    blocks = math.ceil(elements / NF4_BLOCK)
    return math.ceil(elements / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + NF4_TENSOR_CONSTANT_BYTES


def optimizer_state_bytes(optim: str, param_bytes: int) -> float:
    """Optimizer state bytes per trainable parameter for `TrainingArguments.optim`.

    AdamW (torch, fused or not): `exp_avg` and `exp_avg_sq` in the parameter's dtype. bitsandbytes 8-bit variants:
    two uint8 states plus an fp32 absmax per 256 values. `*_32bit` variants: two fp32 states. Lion: one state. SGD
    (no momentum in transformers' default) and Adafactor (factored second moment): ~0. Raises `ValueError` otherwise.
    """
    name = str(getattr(optim, "value", optim)).lower()
    if "8bit" in name:
        return 2 + 2 * 4 / 256
    if "32bit" in name:
        return 1.0 * (4 if "lion" in name else 8)
    if "lion" in name:
        return param_bytes
    if "adam" in name:
        return 2 * param_bytes
    if name.startswith("sgd") or name.startswith("adafactor"):
        return 0.0
    raise ValueError(f"The memory planner does not know the state size of optimizer `optim={name!r}`.")


@dataclass(frozen=True)
class _Dtypes:
    model: int  # b_m: unquantized weights, residual stream, KV cache
    adapter: int  # b_a: LoRA parameters, their gradients
    autocast: int | None  # b_c under bf16 / fp16 autocast, else None
    linear_out: int  # outputs of linear layers in training
    attention: int  # SDPA inputs and outputs in training
    lora_in: int  # what a LoRA matmul consumes (autocast dtype, or the adapter dtype PEFT casts to)


def layer_activation_bytes(
    shape: ModelShape, targets: list[str], rank: int, dtypes: _Dtypes, tokens: int, seq_len: int
) -> int:
    """Bytes autograd saves for one decoder layer over `tokens` = B·S tokens (no gradient checkpointing).

    Per token: `2·4·h + 2·4` (RMSNorm inputs upcast to fp32 and their rsqrt), `4·n_h·d·b_att + 4·n_h` (SDPA's q,
    repeated k and v, output, and fp32 log-sum-exp), `S·b_att` (the attention mask turned into a float bias per
    layer), `3·I·b_lin` (gate, up and SiLU outputs), Qwen3's q/k norm inputs `4·(n_h + n_kv)·(d + 1)`, and for LoRA:
    each targeted linear's `r·b_in` output, and its input — one shared copy when the input already has the LoRA
    input dtype, else one cast copy per targeted linear (PEFT's cast or autocast's, which is not cached for
    activations); the MLP product `I·b_lin` is saved only when down_proj carries LoRA.
    """
    h, inter = shape.hidden_size, shape.intermediate_size
    heads_dim = shape.num_heads * shape.head_dim
    per_token = 2 * 4 * h + 2 * 4
    per_token += 4 * heads_dim * dtypes.attention + 4 * shape.num_heads + seq_len * dtypes.attention
    per_token += 3 * inter * dtypes.linear_out
    if shape.qk_norm:
        per_token += 4 * (shape.num_heads + shape.num_kv_heads) * (shape.head_dim + 1)
    inputs = {  # input site -> (size per token, its dtype, the linears reading it, saved already without LoRA)
        "norm1": (h, dtypes.model, ("q_proj", "k_proj", "v_proj"), False),
        "attention": (heads_dim, dtypes.attention, ("o_proj",), True),
        "norm2": (h, dtypes.model, ("gate_proj", "up_proj"), False),
        "product": (inter, dtypes.linear_out, ("down_proj",), False),
    }
    for size, dtype, readers, saved_anyway in inputs.values():
        reading = [name for name in readers if name in targets]
        if not reading:
            continue
        if dtype == dtypes.lora_in:
            per_token += 0 if saved_anyway else size * dtype
        else:
            per_token += len(reading) * size * dtypes.lora_in
    per_token += len(targets) * rank * dtypes.lora_in
    return tokens * per_token


def log_prob_head_bytes(
    shape: ModelShape, rows: int, seq_len: int, completion_length: int, dtypes: _Dtypes, device: str
) -> int:
    """Working set of TRL 1.16's fused lm-head log-probs (`add_fused_lm_head`), at its largest (the backward).

    It never builds the `(B, S, V)` logits: tokens go through the lm_head in tiles of n = min(N, 4096) tokens x
    c = min(32768, V) vocabulary entries. On a GPU (Triton) only the N = B·C completion tokens are scored: one tile
    `n·c·b` (b: autocast dtype, else the hidden states'), the selected hidden states `N·h·b_m`, their fp32 gradient
    `N·h·4` and the cast back `N·h·b_m`, the cast weight chunk `c·h·b` when the lm_head is not in b, and fp32
    statistics. On the CPU every position is scored (N = B·(S−1)) and the tile math runs in fp32 torch ops:
    `CPU_LOGPROB_BACKWARD_TILES` tiles of `n·c·4` bytes, the reshaped hidden states and their fp32 gradient.
    """
    h = shape.hidden_size
    vocab_tile = min(LOGPROB_VOCAB_TILE, shape.vocab_size)
    if device == "cpu":
        tokens = rows * (seq_len - 1)
        tile = min(tokens, LOGPROB_TOKEN_TILE) * vocab_tile * 4
        return int(
            tokens * h * (dtypes.model + 4) + CPU_LOGPROB_BACKWARD_TILES * tile + tokens * LOGPROB_STATS_PER_TOKEN
        )
    tokens = rows * completion_length
    compute = dtypes.autocast or dtypes.model
    tile = min(tokens, LOGPROB_TOKEN_TILE) * vocab_tile * compute
    casts = (vocab_tile * h + min(tokens, LOGPROB_TOKEN_TILE) * h) * compute if compute != dtypes.model else 0
    return tokens * h * (2 * dtypes.model + 4) + tile + casts + tokens * LOGPROB_STATS_PER_TOKEN


@dataclass(frozen=True)
class _Call:
    """One `generate` call of the rollout: its rows and its prompt length in tokens."""

    rows: int
    prompt_length: int


def rollout_geometry(config: MAGRPOConfig, prompt_length: int) -> tuple[list[_Call], int, int]:
    """`(generate calls, training rows per micro-batch, training sequence length)` of one generation batch.

    MAGRPO: at turn t (0-based) each acting agent of a scheduler phase answers `copies·K^t` rows in one call per
    phase (K = G aligned, G^N cross); the rows of trained agents are trained. AT-GRPO: every acting agent's step is
    one call of `copies` rows. An answer is shown, at most, to every later call: P_t = P + (earlier answers)·C. The
    micro-batch holds ⌈rows / steps_per_generation⌉ rows padded to the longest: S = max P_t + C.
    """
    from .config import ATGRPOConfig
    from .scheduling import resolve_scheduler

    scheduler = resolve_scheduler(config.scheduler)
    copies = config.per_device_train_batch_size * config.steps_per_generation
    per_node = config.joint_actions_per_node(config.num_generations)
    trained = {i for i, name in enumerate(config.agent_names) if name not in config.frozen_agents}
    completion = config.max_completion_length
    calls, train_rows, answers_before = [], 0, 0
    for turn in range(config.num_turns):
        for phase in scheduler.phases(turn, config.num_agents):
            if isinstance(config, ATGRPOConfig):
                for agent in phase:
                    visible = _visible_answers(config.scheduler, turn, answers_before, config.num_agents)
                    calls.append(_Call(copies, prompt_length + visible * completion))
                    train_rows += copies if agent in trained else 0
                    answers_before += 1
            else:
                nodes = copies * per_node**turn
                visible = _visible_answers(config.scheduler, turn, answers_before, config.num_agents)
                calls.append(_Call(nodes * len(phase), prompt_length + visible * completion))
                train_rows += nodes * len(trained.intersection(phase))
                answers_before += len(phase)
    micro_batch = math.ceil(train_rows / config.steps_per_generation)
    return calls, micro_batch, max(call.prompt_length for call in calls) + completion


def _visible_answers(scheduler: str, turn: int, answers_before: int, num_agents: int) -> int:
    """How many earlier answers a prompt shows, at most: the other agents' previous turn under `debate`, every
    earlier answer of the episode otherwise (`parallel`, `sequential`, `round_robin`, and plugins, as a bound)."""
    if scheduler == "debate":
        return num_agents - 1 if turn > 0 else 0
    return answers_before


@dataclass
class MemoryEstimate:
    """A predicted memory breakdown, in bytes. `peak` = the static part + the larger phase + `overhead`.

    Static: `base_weights`, `adapters`, `optimizer_states`. Training phase: `gradients`, `saved_activations`
    (checkpoints or all layers, router weights, autocast weight copies), and the larger of `log_prob_head` and
    `backward_working_set`. Generation phase: `kv_cache`, `routed_lora_weights`, and the larger of
    `prefill_working_set` and `generation_logits`.
    """

    device: str
    base_weights: int
    adapters: int
    optimizer_states: int
    gradients: int
    saved_activations: int
    log_prob_head: int
    backward_working_set: int
    kv_cache: int
    routed_lora_weights: int
    prefill_working_set: int
    generation_logits: int
    overhead: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def static(self) -> int:
        return self.base_weights + self.adapters + self.optimizer_states

    @property
    def training_phase(self) -> int:
        working = max(self.log_prob_head, self.backward_working_set)
        return self.gradients + self.saved_activations + working

    @property
    def generation_phase(self) -> int:
        return self.kv_cache + self.routed_lora_weights + max(self.prefill_working_set, self.generation_logits)

    @property
    def peak(self) -> int:
        return self.static + max(self.training_phase, self.generation_phase) + self.overhead

    @property
    def peak_phase(self) -> str:
        return "training" if self.training_phase >= self.generation_phase else "generation"

    def fits(self, gpu_memory_gb: float) -> bool:
        """Whether the peak fits a card of `gpu_memory_gb` GiB (cards sold as "24 GB" hold 24 GiB)."""
        return self.peak <= gpu_memory_gb * GIB

    def table(self, gpu_memory_gb: tuple[float, ...] | list[float] = ()) -> str:
        """A readable breakdown in MiB; with card sizes, whether the peak fits each."""
        rows = [
            ("base weights", self.base_weights),
            ("LoRA adapters", self.adapters),
            ("optimizer states", self.optimizer_states),
            ("= static", self.static),
            ("training: gradients", self.gradients),
            ("training: saved activations", self.saved_activations),
            ("training: log-prob head (fused lm_head)", self.log_prob_head),
            ("training: backward working set", self.backward_working_set),
            ("= training phase", self.training_phase),
            ("generation: KV cache", self.kv_cache),
            ("generation: router's concatenated LoRA weights", self.routed_lora_weights),
            ("generation: prefill working set", self.prefill_working_set),
            ("generation: last-token logits + sampling", self.generation_logits),
            ("= generation phase", self.generation_phase),
            (
                "overhead (none on the CPU)" if self.device == "cpu" else "overhead (CUDA context + allocator)",
                self.overhead,
            ),
            (f"PEAK ({self.peak_phase} phase)", self.peak),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"{name:<{width}}  {value / MIB:>10,.0f} MiB" for name, value in rows]
        info = ", ".join(f"{key}={value}" for key, value in self.details.items())
        lines.insert(0, f"Predicted memory on {self.device} ({info})")
        for size in gpu_memory_gb:
            verdict = "fits" if self.fits(size) else "does NOT fit"
            lines.append(f"{size:g} GB card: {verdict} ({self.peak / GIB:.1f} of {size:g} GiB)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _model_dtype_bytes(config: MAGRPOConfig, model_config: PretrainedConfig, model_dtype: Any) -> int:
    """b_m: `model_dtype` if given, else `model_init_kwargs["dtype"]`, else float32 (TRL's `create_model_from_path`
    default); "auto" reads the checkpoint's dtype from its config."""
    dtype = model_dtype if model_dtype is not None else (config.model_init_kwargs or {}).get("dtype", "float32")
    if dtype == "auto":
        dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None) or "float32"
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"Model dtype {dtype!r} is not one the planner knows ({list(DTYPE_BYTES)}).")
    return DTYPE_BYTES[name]


def estimate_memory(
    config: MAGRPOConfig,
    model_config: PretrainedConfig | None = None,
    *,
    model_name_or_path: str | None = None,
    load_in_4bit: bool = False,
    prompt_length: int = DEFAULT_PROMPT_LENGTH,
    device: str = "cuda",
    model_dtype: Any = None,
) -> MemoryEstimate:
    """Predict the peak memory of training `config`'s team on one device, before any weight loads.

    Args:
        config: a `MAGRPOConfig` or `ATGRPOConfig` (agents, adapters, batch sizes, lengths, turns, optimizer,
            `gradient_checkpointing`, `bf16`).
        model_config: the base model's `PretrainedConfig`; read with `AutoConfig.from_pretrained(model_name_or_path)`
            (config.json only) when not given; `model_name_or_path` defaults to the embedded default model.
        load_in_4bit: an NF4 base with double quantization (`trl_marl.models.four_bit_config`).
        prompt_length: P, the longest task prompt in tokens, chat template and role included.
        device: `"cuda"` (a GPU: Triton log-prob kernel, bf16 4-bit compute, CUDA overhead) or `"cpu"` (what
            `recipes/benchmarks/bench_memory.py` measures: torch log-prob fallback, fp32 4-bit compute, no overhead).
        model_dtype: the dtype of the unquantized weights; defaults to `model_init_kwargs["dtype"]`, else float32.

    Formulas: the module docstring. Raises `ValueError` for an architecture, LoRA target or optimizer the planner does
    not know.
    """
    if device not in ("cuda", "cpu"):
        raise ValueError(f"`device` must be 'cuda' or 'cpu', got {device!r}.")
    if model_config is None:
        from transformers import AutoConfig

        if model_name_or_path is None:
            from .models import default_model_path

            model_name_or_path = default_model_path()
        model_config = AutoConfig.from_pretrained(model_name_or_path)
    shape = model_shape(model_config)
    targets = targeted_linears(shape, config.lora_target_modules)
    rank, layers, h = config.lora_r, shape.num_layers, shape.hidden_size

    # Byte widths (see _Dtypes).
    b_model = _model_dtype_bytes(config, model_config, model_dtype)
    autocast = 2 if (config.bf16 or config.fp16) else None
    b_adapter = 2 if load_in_4bit else 4  # TRL casts trainable adapters of a quantized base to bf16
    b_linear = b_model if load_in_4bit else (autocast or b_model)  # bitsandbytes casts its output to the input dtype
    b_attention = autocast or b_linear
    dtypes = _Dtypes(b_model, b_adapter, autocast, b_linear, b_attention, autocast or b_adapter)

    # Weights.
    layer_weights = shape.layer_weight_elements()
    if load_in_4bit:
        quantized = sum(nf4_bytes(i * o) for i, o in shape.linears().values()) * layers
        base = quantized + (layers * shape.layer_other_elements() + shape.embedding_elements()) * b_model
    else:
        base = parameter_count(shape) * b_model
    adapter_params = lora_parameters(shape, rank, targets)
    num_adapters = 1 if config.adapter_mode == "shared" else config.num_agents
    frozen = [name for name in config.agent_names if name in config.frozen_agents]
    trained_adapters = 1 if config.adapter_mode == "shared" else config.num_agents - len(frozen)
    frozen_adapters = num_adapters - trained_adapters
    adapters = adapter_params * (trained_adapters * b_adapter + frozen_adapters * 4)  # frozen ones are not cast
    gradients = adapter_params * trained_adapters * b_adapter
    optimizer = int(adapter_params * trained_adapters * optimizer_state_bytes(config.optim, b_adapter))

    # Training: one micro-batch of B rows x S tokens.
    calls, rows, seq_len = rollout_geometry(config, prompt_length)
    tokens = rows * seq_len
    layer = layer_activation_bytes(shape, targets, rank, dtypes, tokens, seq_len)
    linears = shape.linears()
    per_row_lora = rank * sum(sum(linears[name]) for name in targets)  # Σ r·(in + out) of one layer
    routed = num_adapters > 1
    if routed:  # the concatenated A and B, and every agent's projection of every token (and its masked copy)
        projections = tokens * 2 * num_adapters * rank * len(targets)
        layer += (num_adapters * per_row_lora + projections) * dtypes.lora_in
    if autocast and not load_in_4bit and b_model != autocast:
        layer += layer_weights * autocast  # autocast's bf16 copy of each frozen weight, kept for the input gradient
    final_norm = tokens * (4 * h + 4) + tokens * seq_len  # + the boolean (B, 1, S, S) mask all layers share
    checkpointing = bool(getattr(config, "gradient_checkpointing", False))
    residual_grads = 2 * tokens * h * 4
    if checkpointing:
        saved = layers * tokens * h * b_model + final_norm
        backward = 2 * layer + residual_grads  # the recomputed layer and its backward
    else:
        saved = layers * layer + final_norm
        backward = layer + residual_grads
    head = log_prob_head_bytes(shape, rows, seq_len, config.max_completion_length, dtypes, device)

    # Generation: the largest call.
    sort = SORT_BYTES_PER_ENTRY if (config.top_p < 1.0 or (config.top_k or 0) > 0) else 0

    def generation(call: _Call) -> tuple[int, int, int, int]:
        length = call.prompt_length + config.max_completion_length
        kv = 2 * layers * shape.num_kv_heads * shape.head_dim * b_model * call.rows * length
        router = num_adapters * layers * per_row_lora * b_adapter if routed else 0  # concatenated adapters
        prefill_tokens = call.rows * call.prompt_length
        heads_dim = shape.num_heads * shape.head_dim
        prefill = prefill_tokens * (
            2 * h * b_model + 4 * h + 4 * heads_dim * b_model + 3 * shape.intermediate_size * b_model
        )
        prefill += call.rows * call.prompt_length**2 * (b_model + 1)  # the mask as bool and as a float bias
        logits = call.rows * shape.vocab_size * (b_model + SAMPLING_BYTES_PER_ENTRY + sort)
        return kv, router, prefill, logits

    kv, router, prefill, logits = max(
        (generation(call) for call in calls), key=lambda parts: parts[0] + parts[1] + max(parts[2:])
    )
    biggest_call = max(calls, key=lambda call: call.rows * (call.prompt_length + config.max_completion_length))

    estimate = MemoryEstimate(
        device=device,
        base_weights=base,
        adapters=adapters,
        optimizer_states=optimizer,
        gradients=gradients,
        saved_activations=saved,
        log_prob_head=head,
        backward_working_set=backward,
        kv_cache=kv,
        routed_lora_weights=router,
        prefill_working_set=prefill,
        generation_logits=logits,
        overhead=0,
        details={
            "parameters": parameter_count(shape),
            "4-bit": load_in_4bit,
            "model dtype bytes": b_model,
            "adapters": num_adapters,
            "LoRA parameters per adapter": adapter_params,
            "training rows per micro-batch": rows,
            "training sequence length": seq_len,
            "gradient checkpointing": checkpointing,
            "largest generate call (rows x prompt)": f"{biggest_call.rows} x {biggest_call.prompt_length}",
        },
    )
    if device == "cuda":
        dynamic = max(estimate.training_phase, estimate.generation_phase)
        estimate.overhead = CUDA_CONTEXT_BYTES + int(ALLOCATOR_SLACK * dynamic)
    return estimate
