"""The precision policy: which half precision a machine computes in, the mixed-precision default of a team's config,
the QLoRA base's 4-bit settings, and the `from_pretrained` keywords of a model given by id or path (its precision and
its placement on this process's device)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import BitsAndBytesConfig
    from trl import GRPOConfig

logger = logging.getLogger("trl_marl")


def half_precision_dtype():
    """The half-precision dtype this machine's accelerator computes in: bf16 on a CUDA GPU that supports it (Ampere
    and newer), fp16 on one that does not (T4, V100: bf16 there fails or is emulated), None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def default_mixed_precision(bf16: bool | None, fp16: bool, use_cpu: bool) -> tuple[bool | None, bool]:
    """`(bf16, fp16)` when the user left `bf16` unset (None), which TRL would turn on.

    - On the CPU (`use_cpu`): float32 (`bf16=False`): bf16 autocast on a CPU without native bf16 made a training step
      9.9x slower (docs/benchmarks.md).
    - On a GPU without bf16 (T4, V100; `half_precision_dtype()` is fp16), where bf16 fails: fp16, with a warning.
    - Otherwise unchanged: TRL's default (bf16 on a GPU that has it). An explicit choice is always kept.

    Without any accelerator that does bf16 and without `use_cpu`, TRL's default fails in transformers' check ("Your
    setup doesn't support bf16/gpu"); this raises first, saying which field to set.
    """
    if bf16 is not None or fp16:
        return bf16, fp16
    if use_cpu:
        return False, False
    import torch
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    if half_precision_dtype() is None and not is_torch_bf16_gpu_available() and not is_torch_xla_available():
        raise ValueError(
            "`bf16` is on by default (as in TRL), but this machine has no GPU that supports it. To train on the CPU, "
            "set `use_cpu=True` (`--use_cpu true` on the command line, `use_cpu: true` in a config): float32; or "
            "set `bf16` / `fp16` yourself."
        )

    if half_precision_dtype() is torch.float16:
        logger.warning(
            "This GPU (%s) does not support bf16, which TRL turns on by default: training in fp16 mixed precision "
            "instead. Set `bf16` or `fp16` explicitly to choose.",
            torch.cuda.get_device_name(),
        )
        return False, True
    return bf16, fp16


def four_bit_config() -> BitsAndBytesConfig:
    """The QLoRA base: 4-bit NF4 weights with double quantization, computing in the GPU's half precision
    (`half_precision_dtype`: bf16, or fp16 where bf16 is unsupported) and in float32 on a CPU (where bf16 matmuls are
    emulated and were 9.9x slower, README "Benchmarks")."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=half_precision_dtype() or torch.float32,
    )


def model_init_kwargs_for(args: GRPOConfig, quantization_config=None) -> dict:
    """`from_pretrained` keywords for a model given by id or path: `args.model_init_kwargs`, the quantization config,
    and the device map.

    Under DDP or DeepSpeed every process holds the whole model on its own device, so `device_map="auto"` (which would
    spread it over every visible GPU) is off. A quantized model must still be placed while it loads (bitsandbytes
    quantizes on the device): it goes to this process's device, `{"": <device>}`, never to `None` (the CPU).
    """
    kwargs = dict(args.model_init_kwargs or {})
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    state = args.distributed_state
    if state.distributed_type in ["MULTI_GPU", "DEEPSPEED"]:
        kwargs["device_map"] = {"": state.device} if kwargs.get("quantization_config") is not None else None
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return kwargs
