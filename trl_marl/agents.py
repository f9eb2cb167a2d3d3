"""Agents on one base model: one LoRA adapter per agent, and the prompt each agent sees."""

import copy
from collections.abc import Sequence
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model

from .config import SHARED_ADAPTER_NAME, MAGRPOConfig


def agent_adapter_names(args: MAGRPOConfig) -> list[str]:
    """The adapter each agent trains with, in agent order (`"team"` for every agent when adapters are shared)."""
    if args.adapter_mode == "shared":
        return [SHARED_ADAPTER_NAME] * args.num_agents
    return list(args.agent_names)


def lora_config_from_args(args: MAGRPOConfig) -> LoraConfig:
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        # PEFT takes the "all-linear" shortcut only as a plain string.
        target_modules="all-linear" if list(args.lora_target_modules) == ["all-linear"] else args.lora_target_modules,
        task_type="CAUSAL_LM",
    )


def attach_agent_adapters(model: Any, adapter_names: Sequence[str], lora_config: LoraConfig) -> PeftModel:
    """Give `model` one trainable LoRA adapter per name (the base stays frozen) and return the `PeftModel`.

    A `PeftModel` that already carries every adapter (e.g. a saved team) is returned with all of them trainable; one
    that lacks some raises `ValueError` naming them.
    """
    unique_names = list(dict.fromkeys(adapter_names))
    if isinstance(model, PeftModel):
        missing = [name for name in unique_names if name not in model.peft_config]
        if missing:
            raise ValueError(
                f"The PeftModel passed as `model` has adapters {sorted(model.peft_config)} but the team needs "
                f"{unique_names}: missing {missing}. Pass the base model instead and let the trainer add the adapters."
            )
    else:
        if lora_config.use_dora and len(unique_names) > 1:
            raise ValueError(
                "DoRA adapters cannot be routed per row by PEFT; set `use_dora=False` in `peft_config`, or share one "
                "adapter (`adapter_mode='shared'`)."
            )
        model = get_peft_model(model, copy.deepcopy(lora_config), adapter_name=unique_names[0])
        for name in unique_names[1:]:
            model.add_adapter(name, copy.deepcopy(lora_config))
    # PEFT creates inactive adapters frozen, and the optimizer only takes parameters that require grad when it is
    # built: without this only the first agent would learn.
    model.set_requires_grad(unique_names, requires_grad=True)
    return model


def is_4bit_linear(layer: torch.nn.Module) -> bool:
    try:
        import bitsandbytes as bnb
    except ImportError:
        return False
    return isinstance(layer, bnb.nn.Linear4bit)


def keep_4bit_weights_trainable(model: torch.nn.Module) -> None:
    """Stop bitsandbytes from repacking 4-bit weights for CPU inference.

    On CPUs with AVX512-BF16, a `Linear4bit` run in eval mode (e.g. `trainer.evaluate()`) repacks its weight into a
    CPU inference layout and keeps it; later training forwards then go through a kernel without autograd, and the
    adapters silently stop receiving gradients.
    """
    for module in model.modules():
        if is_4bit_linear(module):
            module.support_avx512bf16_for_cpu = False


def agent_prompt(system_prompt: str, prompt: str | list[dict], use_chat_template: bool) -> str | list[dict]:
    """The prompt an agent sees: its role (system prompt) followed by the task prompt.

    Conversational prompts (lists of messages) get the role as a system message (merged into an existing one).
    Standard prompts become a conversation when the tokenizer has a chat template, else the role is prepended as text.
    An empty role leaves the task prompt unchanged.
    """
    if isinstance(prompt, str) and not use_chat_template:
        return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if not system_prompt:
        return messages
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{system_prompt}\n\n{messages[0]['content']}"
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]
