"""The static part of the peak: base weights, LoRA adapters and optimizer states, plus the adapters' gradients.

All of them persist across a step except the gradients, which `zero_grad` frees before the next generation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .shape import ModelShape, parameter_count

if TYPE_CHECKING:
    from ..config import MAGRPOConfig

# bitsandbytes NF4: 64 weights per absmax block; with double quantization the absmaxes are uint8 in blocks of 256 with
# an fp32 absmax each; a quantized tensor also holds a 16-entry fp32 NF4 code, a 256-entry fp32 code for the absmaxes
# and an fp32 offset (read from bitsandbytes 0.50's QuantState).
NF4_BLOCK = 64
NESTED_BLOCK = 256
NF4_TENSOR_CONSTANT_BYTES = 16 * 4 + 256 * 4 + 4
# Frozen adapters are loaded as PEFT creates them and never cast: float32.
FROZEN_ADAPTER_BYTES = 4


def nf4_bytes(elements: int) -> int:
    """Bytes of one weight of n = `elements` values in NF4 with double quantization (blocks of 64, see `NF4_BLOCK`):
    `n/2 + n/64 + 4·⌈n/16384⌉ + 1092` (packed 4-bit values, uint8 absmax per block, fp32 absmax per 256 blocks, the
    code tables and offset), each division rounded up."""
    blocks = math.ceil(elements / NF4_BLOCK)
    return math.ceil(elements / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + NF4_TENSOR_CONSTANT_BYTES


def base_weight_bytes(shape: ModelShape, model_bytes: int, load_in_4bit: bool) -> int:
    """The base model's weights: `parameter_count · b_m`.

    In 4-bit NF4 each decoder linear weight takes `nf4_bytes(in·out)`, while embeddings, lm_head, norms and biases stay
    in `b_m`: `L·Σ nf4_bytes(in·out) + (L·(biases + norms) + V·h·(1 or 2) + h)·b_m`.
    """
    if load_in_4bit:
        quantized = sum(nf4_bytes(i * o) for i, o in shape.linears().values()) * shape.num_layers
        return quantized + (shape.num_layers * shape.layer_other_elements() + shape.embedding_elements()) * model_bytes
    return parameter_count(shape) * model_bytes


def adapter_counts(config: MAGRPOConfig, agents: list[int] | None = None) -> tuple[int, int]:
    """`(adapters, trained adapters)`: one adapter per agent (`per_agent`; of `agents` only, the agents on one base
    of a team on several) less the frozen agents', or one in all (`shared`), which trains."""
    if config.adapter_mode == "shared":
        return 1, 1
    names = [config.agent_names[i] for i in (range(config.num_agents) if agents is None else agents)]
    frozen = [name for name in names if name in config.frozen_agents]
    return len(names), len(names) - len(frozen)


def critic_count(config: MAGRPOConfig, agents: list[int] | None = None) -> int:
    """The critics' adapters of an actor-critic config (`IACConfig`: one per agent, `MAACConfig`: one), all trained,
    on the team's first base (`agents` holding agent 0, or None); 0 for the other algorithms. Each also has a value
    head of `hidden_size + 1` floats, which no term counts."""
    kind = getattr(config, "_critic_kind", "")
    if not kind or (agents is not None and 0 not in agents):
        return 0
    return config.num_agents if kind == "iac" else 1


def adapter_bytes(parameters: int, adapters: int, trained: int, adapter_width: int) -> int:
    """The LoRA adapters: `P·(n_trained·b_a + n_frozen·4)`, P = `parameters` each (`lora_parameters`), b_a =
    `adapter_width`, n_frozen = `adapters - trained`; frozen adapters are not cast and stay float32."""
    return parameters * (trained * adapter_width + (adapters - trained) * FROZEN_ADAPTER_BYTES)


def gradient_bytes(parameters: int, trained: int, adapter_width: int) -> int:
    """Gradients of the trainable adapters only: `P·n_trained·b_a`."""
    return parameters * trained * adapter_width


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


def optimizer_bytes(parameters: int, trained: int, optim: str, adapter_width: int) -> int:
    """Optimizer states of the trainable adapters: `P·n_trained·s` with s = `optimizer_state_bytes` (AdamW `2·b_a`).
    States persist from the first step, so they count in both phases."""
    return int(parameters * trained * optimizer_state_bytes(optim, adapter_width))
