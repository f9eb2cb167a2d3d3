"""The byte widths the planner's formulas use: `b_m` (model), `b_a` (adapters), `b_c` (autocast), and the dtypes
that follow from them for the tensors a training step saves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..config import MAGRPOConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ByteWidths:
    """Bytes per value of each kind of tensor (see `byte_widths`)."""

    model: int  # b_m: unquantized weights, residual stream, KV cache
    adapter: int  # b_a: LoRA parameters, their gradients
    autocast: int | None  # b_c under bf16 / fp16 autocast, else None
    linear_out: int  # outputs of linear layers in training
    attention: int  # SDPA inputs and outputs in training
    lora_in: int  # what a LoRA matmul consumes (autocast dtype, or the adapter dtype PEFT casts to)


def model_dtype_bytes(config: MAGRPOConfig, model_config: PretrainedConfig, model_dtype: Any) -> int:
    """b_m: `model_dtype` if given, else `model_init_kwargs["dtype"]`, else float32 (TRL's `create_model_from_path`
    default); "auto" reads the checkpoint's dtype from its config. Raises `ValueError` for a dtype not in
    `DTYPE_BYTES`."""
    dtype = model_dtype if model_dtype is not None else (config.model_init_kwargs or {}).get("dtype", "float32")
    if dtype == "auto":
        dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None) or "float32"
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"Model dtype {dtype!r} is not one the planner knows ({list(DTYPE_BYTES)}).")
    return DTYPE_BYTES[name]


def byte_widths(
    config: MAGRPOConfig, model_config: PretrainedConfig, model_dtype: Any, load_in_4bit: bool
) -> ByteWidths:
    """The byte widths of a training run.

    `b_m` from `model_dtype_bytes` (the dtype of every weight that is not 4-bit); `b_c = 2` with `bf16` / `fp16`;
    `b_a = 4`, or 2 on a 4-bit base, where TRL casts trainable adapters to bf16. Linear outputs are in `b_c`, but in
    `b_m` on a 4-bit base (bitsandbytes casts its output to the input dtype); SDPA runs in `b_c`, else in the linear
    outputs' dtype; LoRA consumes `b_c`, else `b_a` (PEFT casts its input to the adapter's dtype).
    """
    model = model_dtype_bytes(config, model_config, model_dtype)
    autocast = 2 if (config.bf16 or config.fp16) else None
    adapter = 2 if load_in_4bit else 4
    linear_out = model if load_in_4bit else (autocast or model)
    return ByteWidths(model, adapter, autocast, linear_out, autocast or linear_out, autocast or adapter)
