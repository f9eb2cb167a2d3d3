"""The training phase: what one micro-batch of B sequences of S tokens holds at the peak of its forward and backward.

`gradients` (see `weights.gradient_bytes`) + `saved_activation_bytes` + the larger of `log_prob_head_bytes` and
`backward_working_set_bytes`; one layer's activations are `training_layer_bytes`.
"""

from __future__ import annotations

from .dtypes import ByteWidths
from .shape import ModelShape, layer_lora_parameters

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


def layer_activation_bytes(
    shape: ModelShape, targets: list[str], rank: int, dtypes: ByteWidths, tokens: int, seq_len: int
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


def routed_activation_bytes(
    shape: ModelShape, targets: list[str], rank: int, adapters: int, tokens: int, lora_in: int
) -> int:
    """What the router adds to one layer's saved activations with N = `adapters` > 1 (else 0): the N adapters
    concatenated along the rank, `N·r·Σ(in + out)`, and every agent's rank-space projection of every token and its
    masked copy, `2·N·r` per targeted linear and token, all in the LoRA input dtype `b_in`."""
    if adapters <= 1:
        return 0
    projections = tokens * 2 * adapters * rank * len(targets)
    return (adapters * layer_lora_parameters(shape, rank, targets) + projections) * lora_in


def autocast_weight_copy_bytes(shape: ModelShape, dtypes: ByteWidths, load_in_4bit: bool) -> int:
    """Autocast's `b_c` copy of each frozen weight of a layer, kept for the input gradient: `Σ in·out · b_c`, when
    autocast runs on unquantized weights of another dtype (else 0)."""
    if dtypes.autocast and not load_in_4bit and dtypes.model != dtypes.autocast:
        return shape.layer_weight_elements() * dtypes.autocast
    return 0


def training_layer_bytes(
    shape: ModelShape,
    targets: list[str],
    rank: int,
    dtypes: ByteWidths,
    rows: int,
    seq_len: int,
    adapters: int,
    load_in_4bit: bool,
) -> int:
    """One decoder layer's activations in training over B·S tokens: `layer_activation_bytes` +
    `routed_activation_bytes` + `autocast_weight_copy_bytes`."""
    tokens = rows * seq_len
    layer = layer_activation_bytes(shape, targets, rank, dtypes, tokens, seq_len)
    layer += routed_activation_bytes(shape, targets, rank, adapters, tokens, dtypes.lora_in)
    return layer + autocast_weight_copy_bytes(shape, dtypes, load_in_4bit)


def saved_activation_bytes(
    shape: ModelShape, layer_bytes: int, rows: int, seq_len: int, model_bytes: int, checkpointing: bool
) -> int:
    """What the forward keeps for the backward over B·S tokens: all L layers, `L·layer_bytes`, or with gradient
    checkpointing each layer's input only, `L·B·S·h·b_m`; plus the final norm's fp32 input and rsqrt `B·S·(4·h + 4)`
    and the boolean (B, 1, S, S) mask all layers share, `B·S·S`."""
    tokens = rows * seq_len
    final_norm = tokens * (4 * shape.hidden_size + 4) + tokens * seq_len
    if checkpointing:
        return shape.num_layers * tokens * shape.hidden_size * model_bytes + final_norm
    return shape.num_layers * layer_bytes + final_norm


def backward_working_set_bytes(shape: ModelShape, layer_bytes: int, tokens: int, checkpointing: bool) -> int:
    """The backward's working set: the gradients of one layer's intermediates (`layer_bytes`, twice with gradient
    checkpointing: the recomputed layer and its backward) and the fp32 residual gradients `2·B·S·h·4`."""
    residual_grads = 2 * tokens * shape.hidden_size * 4
    return (2 if checkpointing else 1) * layer_bytes + residual_grads


def log_prob_head_bytes(
    shape: ModelShape, rows: int, seq_len: int, completion_length: int, dtypes: ByteWidths, device: str
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
