"""Agents on one base model: one LoRA adapter per agent, and the prompt each agent sees."""

import copy
import re
from collections.abc import Sequence
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model

SHARED_ADAPTER_NAME = "team"
# "ref" would be taken by TRL for its reference adapter, "__base__" means "no adapter" to PEFT.
RESERVED_AGENT_NAMES = ("ref", "__base__", "default")
_AGENT_NAME_PATTERN = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
# PEFT matches adapter names inside parameter names (`...q_proj.lora_A.<name>.weight`) and warns that an adapter
# whose name is contained in the prefix `lora_` may be re-initialised when it is loaded. Refused: every piece of
# `lora_` that is a valid name (a, a_, l, lo, lor, lora, lora_, o, or, ora, ora_, r, ra, ra_).
LORA_PREFIX = "lora_"
# The keys of an `agents` entry that put the agent on a base model of its own, and the dtypes it may be loaded in.
BASE_KEYS = ("model", "load_in_4bit", "dtype")
BASE_DTYPES = ("auto", "bfloat16", "float16", "float32")
LORA_PREFIX_PIECES = sorted(
    {
        LORA_PREFIX[i:j]
        for i in range(len(LORA_PREFIX))
        for j in range(i + 1, len(LORA_PREFIX) + 1)
        if _AGENT_NAME_PATTERN.match(LORA_PREFIX[i:j])
    }
)


def normalize_agents(agents: Any) -> list[dict[str, str]]:
    """Turn the `agents` field into a list of `{"name": str, "system_prompt": str}` dicts.

    Each entry may be a name (`"writer"`) or a mapping with a `name` and an optional `system_prompt` (alias `role`),
    and optionally the agent's own base model: `model` (Hub id or folder), with its `load_in_4bit` and `dtype`
    (`team/bases.py`); these keys are kept only when given.
    Raises `ValueError` naming the field and the offending entry when an entry is malformed, a name is not a valid
    adapter / folder name, or two agents share a name.
    """
    if agents is None or (isinstance(agents, (list, tuple)) and len(agents) == 0):
        raise ValueError(
            f"`agents` is empty (got {agents!r}): a team needs at least one agent, e.g. "
            "agents=[{'name': 'concise', 'system_prompt': 'Answer in one sentence.'}, {'name': 'detailed'}]."
        )
    if isinstance(agents, (str, dict)) or not isinstance(agents, (list, tuple)):
        raise ValueError(
            f"`agents` must be a list of agent names or {{'name', 'system_prompt'}} dicts, not {agents!r}."
        )
    normalized = []
    for index, agent in enumerate(agents):
        if isinstance(agent, str):
            agent = {"name": agent}
        if not isinstance(agent, dict) or "name" not in agent:
            raise ValueError(f"`agents[{index}]` must be a name or a dict with a 'name' key, got {agent!r}.")
        unknown = set(agent) - {"name", "system_prompt", "role", "tools", *BASE_KEYS}
        if unknown:
            raise ValueError(
                f"`agents[{index}]` has unknown keys {sorted(unknown)}; allowed keys are 'name', 'system_prompt', "
                f"'tools', and for an agent's own base model {', '.join(repr(key) for key in BASE_KEYS)}."
            )
        name = agent["name"]
        if not isinstance(name, str) or not _AGENT_NAME_PATTERN.match(name) or name in RESERVED_AGENT_NAMES:
            raise ValueError(
                f"`agents[{index}]` has name {name!r}: an agent name names its LoRA adapter and its output folder, so "
                f"it must start with a letter and contain only letters, digits, '_' and '-', and must not be one of "
                f"{list(RESERVED_AGENT_NAMES)}."
            )
        if name in LORA_PREFIX:
            raise ValueError(
                f"`agents[{index}]` has name {name!r}, which is a piece of 'lora_', the prefix of PEFT's LoRA "
                "parameter names: PEFT would find the name in every LoRA parameter and may re-initialise the adapter "
                f"when loading it. Names that are a piece of 'lora_' are refused: {', '.join(LORA_PREFIX_PIECES)}. "
                f"Choose another name (e.g. '{name}1')."
            )
        system_prompt = agent.get("system_prompt", agent.get("role")) or ""
        if not isinstance(system_prompt, str):
            raise ValueError(f"`agents[{index}]['system_prompt']` must be a string, got {system_prompt!r}.")
        entry = {"name": name, "system_prompt": system_prompt, **agent_base_keys(agent, index)}
        if agent.get("tools") is not None:
            entry["tools"] = agent_tool_names(agent["tools"], index)
        normalized.append(entry)
    names = [agent["name"] for agent in normalized]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"`agents` has duplicate names {duplicates} (got {names}); every agent needs a unique name.")
    return normalized


def agent_tool_names(tools: Any, index: int) -> list:
    """`agents[index]['tools']`, checked: a list of callables (in Python), importable names
    (`"package.module:function"`, in a config file) and names of the environment's methods the agent keeps to;
    resolved when the trainer starts (`tool_calling.TeamTools`)."""
    if callable(tools) or isinstance(tools, str):
        tools = [tools]
    if not isinstance(tools, (list, tuple)) or not all(callable(tool) or isinstance(tool, str) for tool in tools):
        raise ValueError(
            f"`agents[{index}]['tools']` must be a list of functions or importable names "
            f"('package.module:function'), got {tools!r}."
        )
    for tool in tools:
        if isinstance(tool, str) and not re.match(r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$", tool):
            raise ValueError(
                f"`agents[{index}]['tools']` names {tool!r}, which is neither an importable name "
                "('package.module:function') nor an environment method's name."
            )
    return list(tools)


def agent_base_keys(agent: dict, index: int) -> dict:
    """The keys of `agents[index]` that give it its own base model (`model`, and that model's `load_in_4bit` and
    `dtype`), checked; an agent without them sits on the trainer's model."""
    keys = {key: agent[key] for key in BASE_KEYS if agent.get(key) is not None}
    model = keys.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise ValueError(f"`agents[{index}]['model']` must be a Hub model id or a local folder, got {model!r}.")
    if "model" not in keys and keys:
        raise ValueError(
            f"`agents[{index}]` sets {sorted(keys)} without 'model': an agent's own loading goes with its own base "
            "model. Name the model, or set the loading for the whole team (the trainer's `quantization_config`, "
            "`model_init_kwargs`)."
        )
    if not isinstance(keys.get("load_in_4bit", False), bool):
        raise ValueError(f"`agents[{index}]['load_in_4bit']` must be true or false, got {keys['load_in_4bit']!r}.")
    if keys.get("dtype", "auto") not in BASE_DTYPES:
        raise ValueError(f"`agents[{index}]['dtype']` must be one of {list(BASE_DTYPES)}, got {keys['dtype']!r}.")
    return keys


def agent_adapter_names(agent_names: Sequence[str], adapter_mode: str) -> list[str]:
    """The adapter each agent trains with, in agent order (`"team"` for every agent when adapters are shared)."""
    if adapter_mode == "shared":
        return [SHARED_ADAPTER_NAME] * len(agent_names)
    return list(agent_names)


def agent_lora_config(r: int, alpha: int, dropout: float, target_modules: Sequence[str] | str) -> LoraConfig:
    """Every agent's `LoraConfig` (a team config's `lora_*` fields)."""
    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        # PEFT takes the "all-linear" shortcut only as a plain string.
        target_modules="all-linear" if list(target_modules) == ["all-linear"] else target_modules,
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


def adapter_parameters(model: torch.nn.Module, adapter_names: list[str]) -> dict[str, list[torch.nn.Parameter]]:
    """Each adapter's parameters, found by PEFT's naming: `...<container>.<adapter>.<weight>` where the container is
    a `lora_*` module dict (`lora_A`, `lora_B`, `lora_magnitude_vector`, ...) or `modules_to_save`."""
    found = {name: [] for name in adapter_names}
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        for container, adapter in zip(parts, parts[1:]):
            if adapter in found and (container.startswith("lora_") or container == "modules_to_save"):
                found[adapter].append(parameter)
                break
    return found


def cast_frozen_adapters_like_trained(model: torch.nn.Module, trained_adapters: list[str]) -> None:
    """Give the LoRA matrices of frozen adapters the dtype of the trained ones.

    On a quantized base TRL casts the adapter weights that require grad to bf16 (QLoRA's recommendation); frozen
    adapters require none, stay float32, and would turn every routed matmul of a mixed batch (the agents' matrices
    are concatenated) into a float32 one.
    """
    parameters = adapter_parameters(model, list(model.peft_config))
    trained = [p for name in trained_adapters for p in parameters.get(name, []) if p.ndim == 2]
    if not trained:
        return
    dtype = trained[0].dtype
    for name, params in parameters.items():
        if name not in trained_adapters:
            for param in params:
                if param.ndim == 2 and param.is_floating_point() and param.dtype != dtype:
                    param.data = param.data.to(dtype)


def check_adapters_train(
    parameters: dict[str, list[torch.nn.Parameter]],
    agent_names: list[str],
    agent_adapters: list[str],
    trained_adapters: list[str],
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Every trained agent's adapter requires grad and is in `optimizer`; a frozen one requires no grad.

    A PEFT call that ends in `set_adapter` (`disable_adapter()`, `use_adapter(model, None)`) turns gradients off on
    every adapter but the active one, and the agents concerned would silently stop learning. `parameters` are
    [`adapter_parameters`]; pass `optimizer=None` where DeepSpeed or FSDP flatten the parameters into their own buffers
    (its membership is then not checked).

    Raises:
        RuntimeError: naming each adapter, its agents and what is wrong.
    """
    in_optimizer = None
    if optimizer is not None:
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    problems = []
    for adapter, params in parameters.items():
        agents = [name for name, used in zip(agent_names, agent_adapters) if used == adapter]
        trained = adapter in trained_adapters
        if trained and not all(p.requires_grad for p in params):
            problems.append(f"adapter '{adapter}' of agents {agents} no longer requires grad")
        elif trained and in_optimizer is not None and not all(id(p) in in_optimizer for p in params):
            problems.append(f"adapter '{adapter}' of agents {agents} is not in the optimizer")
        elif not trained and any(p.requires_grad for p in params):
            problems.append(f"adapter '{adapter}' of frozen agents {agents} requires grad")
    if problems:
        raise RuntimeError(
            "The agents' adapters are not all training as configured: "
            + "; ".join(problems)
            + ". Something called PEFT's `set_adapter` (directly, or through `disable_adapter()` / TRL's "
            "`use_adapter`), which turns gradients off on every adapter but the active one, or built the "
            "optimizer from some adapters only. Route rows with `trainer.router` instead, and pass an optimizer "
            "over every trained adapter."
        )
