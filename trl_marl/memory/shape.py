"""The architecture the planner counts: a Llama-shaped decoder's dimensions, its parameters and its LoRA parameters.

Notation: V vocabulary, h hidden size, I MLP intermediate size, L layers, n_h attention heads, n_kv key/value heads,
d head dimension, r LoRA rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

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
    """All parameters: `L·(Σ in·out + biases + norms) + V·h·(1 or 2) + h`.

    Per layer: attention `h·n_h·d + 2·h·n_kv·d + n_h·d·h` (+ biases), MLP `3·h·I`, norms `2·h` (+ `2·d` for Qwen3's
    q/k norms); plus embeddings `V·h`, the final norm `h`, and an untied lm_head `V·h`.
    """
    layer = shape.layer_weight_elements() + shape.layer_other_elements()
    return shape.num_layers * layer + shape.embedding_elements()


def targeted_linears(shape: ModelShape, target_modules: list[str] | str) -> list[str]:
    """The linear names of a layer that carry LoRA: all of them for `"all-linear"` (PEFT leaves out lm_head), else
    those named.

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


def layer_lora_parameters(shape: ModelShape, rank: int, targets: list[str]) -> int:
    """Parameters of one adapter in one decoder layer: `Σ_targeted r·(in + out)` over the linear names `targets`."""
    linears = shape.linears()
    return rank * sum(sum(linears[name]) for name in targets)


def lora_parameters(shape: ModelShape, rank: int, target_modules: list[str] | str) -> int:
    """Parameters of one LoRA adapter: `L · Σ_targeted r·(in + out)`."""
    return shape.num_layers * layer_lora_parameters(shape, rank, targeted_linears(shape, target_modules))
