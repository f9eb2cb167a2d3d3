"""Agents on one base model: one LoRA adapter per agent, and per-row routing of a batch to its agents' adapters."""

import copy
from collections.abc import Sequence
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import AuxiliaryTrainingWrapper

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


class AdapterRouter:
    """Routes row `i` of every forward to adapter `row_adapters[i]`, in training as in generation.

    PEFT's LoRA layers already compute a mixed-adapter batch when given `adapter_names=` (one adapter per row), but
    `PeftModel` only accepts that argument in eval mode, through hooks that live for one call. The router installs
    the same injection as persistent hooks, so the routing set before a training forward is still in place when
    gradient checkpointing recomputes that forward during the backward pass.
    """

    def __init__(self, model: PeftModel):
        self.row_adapters: list[str] | None = None
        self._handles = []
        for module in model.modules():
            if isinstance(module, (LoraLayer, AuxiliaryTrainingWrapper)):
                self._handles.append(module.register_forward_pre_hook(self._inject_adapter_names, with_kwargs=True))
            if isinstance(module, LoraLayer) and _is_4bit(module.get_base_layer()):
                # PEFT's 4-bit layer clones the base output before adding LoRA deltas in its single-adapter path, not
                # in its mixed-batch path, whose in-place add then fails under autograd: clone it here too.
                self._handles.append(module.get_base_layer().register_forward_hook(self._clone_output))

    def _inject_adapter_names(self, module, args, kwargs):
        if self.row_adapters is not None:
            kwargs["adapter_names"] = self.row_adapters
        return args, kwargs

    def _clone_output(self, module, args, output):
        if self.row_adapters is not None and torch.is_grad_enabled():
            return output.clone()
        return None

    def route(self, row_adapters: Sequence[str] | None) -> None:
        """Route the rows of the next forward calls (until the next `route`); `None` uses the active adapter."""
        self.row_adapters = list(row_adapters) if row_adapters is not None else None

    def remove(self) -> None:
        """Remove the hooks (the model then behaves as plain PEFT again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.row_adapters = None


def _is_4bit(layer: torch.nn.Module) -> bool:
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
    try:
        import bitsandbytes as bnb
    except ImportError:
        return
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
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


def completion_text(completion: str | list[dict]) -> str:
    """Text of one generated completion, whether TRL returned it as a string or as assistant messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if isinstance(m.get("content"), str))
