"""A team on several base models: which agents sit on which base, and how each base loads, is saved and is rebuilt.

An `agents` entry may name its own `model` (a Hub id or a local folder) and that model's loading (`load_in_4bit`,
`dtype`); an agent that names none sits on the trainer's model. Agents on one base share one loaded model, one
`PeftModel` carrying one adapter per agent, one router and one captured decoder (`TeamBase`): a one-base team is
exactly today's team. The bases are planned and checked before anything loads (`plan_bases`), and each is loaded once
(`BasePlan.load`) and prepared as TRL prepares its model (`prepare_base`).

In the trainer the first agent's base is TRL's model; every other base is registered as a submodule of it
(`TEAM_BASES`), so that what `Trainer` does to its model (the optimizer, gradient clipping, `zero_grad`, train and eval
modes, moves to a device) reaches every base's adapters exactly as it reaches the first base's. A base's adapters are
saved and reloaded in place (`save_base_adapters`, `load_base_adapters`); a saved team's base is rebuilt with each
adapter from its own saved config (`saved_adapters_model`), for `load_team` and `evaluate_task` alike. How each base
generates its own rows, and the token ids carried to it, is `base_generation.py`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.trainer.utils import create_model_from_path

from ..agents import BASE_DTYPES

# TEAM_BASES: the attribute of the first base's PeftModel holding the others.
from ..generation.routing import OTHER_BASES as TEAM_BASES
from .default_model import DEFAULT_MODEL_ID, default_model_path, is_default_model
from .hub import portable_base_name


def model_key(name: str) -> str:
    """What makes two model names one base: the default model by its Hub id, a local folder by its real path."""
    if is_default_model(name):
        return DEFAULT_MODEL_ID
    return os.path.realpath(name) if os.path.isdir(name) else name


def loadable(name: str) -> str:
    """Where to load `name` from: the embedded default model's Hub id from its local copy (found offline too), anything
    else as named."""
    return default_model_path() if name == DEFAULT_MODEL_ID else name


@dataclass
class BasePlan:
    """One base model of a team, before anything loads: the name it is recorded under, what to load (the trainer's
    model object for the trainer's own base), how (its quantization config, and a dtype in place of the team's), and
    the indices of the agents that sit on it."""

    name: str
    source: Any
    quantization_config: Any = None
    dtype: str | None = None
    agents: list[int] = field(default_factory=list)
    trainer_base: bool = False  # the trainer's own `model`: loaded exactly as a one-base team's
    loading: dict = field(default_factory=dict)  # how it loaded (`loading_of`), once `load` ran

    def load(self, args):
        """The base model: the trainer's own object as given, or loaded with TRL's `create_model_from_path` and the
        trainer's `from_pretrained` keywords (`precision.model_init_kwargs_for`) with this base's quantization and
        dtype. Keeps how it loaded in `loading`."""
        if isinstance(self.source, str):
            from ..precision import model_init_kwargs_for

            kwargs = model_init_kwargs_for(args, self.quantization_config)
            if self.dtype is not None:
                kwargs["dtype"] = self.dtype
            model = create_model_from_path(self.source if self.trainer_base else loadable(self.source), **kwargs)
        else:
            model = self.source
        self.loading = loading_of(model)
        return model


def loading_of(model) -> dict:
    """How a base model was loaded, as an agent on it records it in `team.json` so that `load_team` loads it alike:
    `load_in_4bit`, and `dtype`, the dtype of its floating-point weights (TRL loads a model in float32 unless told
    otherwise, whatever its checkpoint's dtype), when `agents` accepts it."""
    loading = {"load_in_4bit": bool(getattr(model, "is_loaded_in_4bit", False))}
    dtype = str(getattr(model, "dtype", "")).removeprefix("torch.")
    if dtype in BASE_DTYPES:
        loading["dtype"] = dtype
    return loading


def spec_bases(spec: dict) -> dict[str, list[int]]:
    """The bases of a saved team (`team.json`), the first agent's first: each base's recorded name and the indices of
    its agents (an agent without `model` sits on `base_model`)."""
    groups: dict[str, list[int]] = {}
    for index, agent in enumerate(spec["agents"]):
        groups.setdefault(agent.get("model", spec["base_model"]), []).append(index)
    return groups


def plan_bases(args, model: Any, quantization_config=None, base_models: dict | None = None) -> list[BasePlan]:
    """The team's bases, the first agent's first, from the config's `agents` and the trainer's `model` (an id, a
    folder or a loaded model): one per distinct model. `base_models` maps agents' own `model` names to loaded models
    used as given (a saved team's bases, as `evaluate_task` passes them). Raises `ValueError`, before anything loads,
    naming the agents and fields when agents on one model ask for different loadings, when the trainer's loaded model
    carries no agent, when `base_models` names a model no agent names, when two bases would be recorded under one name
    in `team.json`, or when several bases meet what cannot serve them (vLLM, one shared adapter, several processes, a
    `PeftModel` without exactly its agents' adapters)."""
    loaded = {model_key(name): base for name, base in (base_models or {}).items()}
    if isinstance(model, str):
        trainer_name = model
        trainer_4bit = quantization_config is not None and getattr(quantization_config, "load_in_4bit", False)
        trainer_dtype = (args.model_init_kwargs or {}).get("dtype")
    else:
        trainer_name = getattr(getattr(model, "config", None), "_name_or_path", "") or "the trainer's model"
        trainer_4bit = bool(getattr(model, "is_loaded_in_4bit", False))
        trainer_dtype = str(getattr(model, "dtype", "")).removeprefix("torch.") or None
    trainer_dtype = None if trainer_dtype is None else str(trainer_dtype).removeprefix("torch.")
    trainer_key = model_key(trainer_name)
    plans: dict[str, BasePlan] = {}
    asked: dict[str, list[tuple[str, bool, str | None]]] = {}  # per base: (who, 4-bit, dtype) of everyone on it
    for index, agent in enumerate(args.agents):
        own = agent.get("model")
        key = trainer_key if own is None else model_key(own)
        load_in_4bit = agent.get("load_in_4bit", trainer_4bit)
        dtype = agent.get("dtype", trainer_dtype)
        if key not in plans:
            if key == trainer_key:  # loaded as the trainer loads its model
                plans[key] = BasePlan(trainer_name, model, quantization_config, trainer_base=True)
                asked[key] = [("the trainer's model", trainer_4bit, trainer_dtype)]
            else:
                plans[key], asked[key] = BasePlan(own, loaded.get(key, own)), []
        plans[key].agents.append(index)
        asked[key].append((f"agent '{agent['name']}'", load_in_4bit, dtype))
    for key, settings in asked.items():
        if len({(four_bit, dtype) for _, four_bit, dtype in settings}) > 1:
            listed = "; ".join(
                f"{who}: load_in_4bit={four_bit}, dtype={dtype or 'default'}" for who, four_bit, dtype in settings
            )
            raise ValueError(
                f"`agents`: {plans[key].name} is loaded once for every agent on it, but they ask for different "
                f"loadings ({listed}). Give them the same `load_in_4bit` and `dtype`."
            )
    for key, plan in plans.items():
        if not plan.trainer_base:  # loaded with the loading its agents agree on
            _, four_bit, plan.dtype = asked[key][0]
            if four_bit:
                from ..precision import four_bit_config

                given = quantization_config is not None and getattr(quantization_config, "load_in_4bit", False)
                plan.quantization_config = quantization_config if given else four_bit_config()
    bases = list(plans.values())
    own_models = {key for key, plan in plans.items() if not plan.trainer_base}
    unused = [name for name in base_models or {} if model_key(name) not in own_models]
    if unused:
        raise ValueError(
            f"`base_models` gives models for {unused}, which no agent names as its own `model` (the agents' models: "
            f"{[base.name for base in bases if not base.trainer_base]}). Key each loaded model by an agent's `model`."
        )
    for base in bases:
        if not base.trainer_base and isinstance(base.source, str):
            check_base_exists(base.source, [args.agents[i]["name"] for i in base.agents], args.trust_remote_code)
    if not isinstance(model, str) and trainer_key not in plans:
        raise ValueError(
            f"Every agent names its own `model`, so the model passed to the trainer ({trainer_name}) carries none. "
            "Leave `model` off the agents that should sit on it, or pass one of the agents' models."
        )
    check_recorded_names(bases)
    if len(bases) > 1:
        check_several_bases_supported(args, bases)
    return bases


def check_recorded_names(bases: Sequence[BasePlan]) -> None:
    """Two bases must not be recorded under one name in `team.json` (`hub.portable_base_name`: a local base by its
    folder's name), or a saved team would load them as one: a `ValueError` naming both, before anything loads."""
    recorded: dict[str, str] = {}
    for base in bases:
        name = portable_base_name(base.name)
        if name in recorded:
            raise ValueError(
                f"`agents`: {recorded[name]} and {base.name} are two base models, but they would both be recorded as "
                f"{name!r} in team.json (a local base by its folder's name, never its path on this machine), and a "
                "saved team would load them as one. Rename one of the folders."
            )
        recorded[name] = base.name


def check_base_exists(name: str, agents: Sequence[str], trust_remote_code: bool = False) -> None:
    """An agent's own model must be found before anything loads: its config.json read from a local folder, the Hub or
    its cache (a few kilobytes; the embedded default model is always found); otherwise a `ValueError` naming the
    agents and the model."""
    from transformers import AutoConfig

    if model_key(name) == DEFAULT_MODEL_ID:
        return
    try:
        AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        who = ", ".join(f"'{agent}'" for agent in agents)
        raise ValueError(
            f"`agents`: the model of {who}, {name!r}, cannot be found ({' '.join(str(error).split())[:200]}). Name a "
            "Hub model id or a local folder holding its config.json."
        ) from error


def check_several_bases_supported(args, plans: Sequence[BasePlan]) -> None:
    """Refuse, naming the field, what cannot serve a team on several bases."""
    from peft import PeftModel

    bases = f"{len(plans)} base models ({', '.join(plan.name for plan in plans)})"
    if args.use_vllm:
        raise ValueError(
            f"`use_vllm=True` with agents on {bases}: a team's vLLM engine serves one base and its agents' LoRAs. "
            "Generate with transformers (`use_vllm=False`; the captured decode step serves each base), or put every "
            "agent on one base."
        )
    if args.adapter_mode == "shared":
        raise ValueError(
            f"`adapter_mode='shared'` with agents on {bases}: one adapter cannot sit on several bases. Use "
            "`adapter_mode='per_agent'`."
        )
    if args.world_size > 1 or args.deepspeed or args.fsdp:
        raise ValueError(
            f"Agents on {bases} train in one process without DeepSpeed or FSDP for now ({args.world_size} "
            "processes were started): every base but the first would run outside the first one's distributed "
            "wrapper. Launch one process without `deepspeed` / `fsdp`, or put every agent on one base."
        )
    for plan in plans:
        agents = [args.agents[i]["name"] for i in plan.agents]  # each agent's adapter is named after it
        if isinstance(plan.source, PeftModel) and sorted(plan.source.peft_config) != sorted(agents):
            raise ValueError(
                f"A PeftModel passed for {plan.name} carries the adapters {sorted(plan.source.peft_config)}, but the "
                f"agents on it are {agents} and the team sits on {bases}: each base's PeftModel must carry exactly "
                "its own agents' adapters. Pass the base model (or its id) and let the trainer add the adapters."
            )


@dataclass
class TeamBase:
    """One loaded base of a team: its `PeftModel` (one adapter per agent on it), tokenizer, the indices of its
    agents, router, captured decoder (None for eager `generate`), generation (`TeamGeneration`), the tokens that end
    its completions and, for a base other than the trainer's, how it loaded (`loading`)."""

    name: str
    model: Any
    tokenizer: Any
    agents: list[int]
    router: Any
    decoder: Any
    generation: Any
    eos_token_ids: list[int]
    loading: dict = field(default_factory=dict)  # another base's `BasePlan.loading`, for `team.json`

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id


def base_tokenizer(name: str):
    """A base's tokenizer, prepared as TRL prepares the trainer's: its pad token falls back to its EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(loadable(name), truncation_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prepare_base(model, args, temperature: float) -> None:
    """What TRL's `__init__` does to the trainer's `PeftModel`, done to another base: input gradients for gradient
    checkpointing, bf16 trained adapters on a quantized base (QLoRA), and the fused LM head its log-probs come from
    (`add_fused_lm_head`, at the sampling temperature); then gradient checkpointing itself, which `Trainer` turns on
    for its own model only."""
    from trl.trainer.utils import add_fused_lm_head

    if args.gradient_checkpointing:
        model.enable_input_require_grads()
        # As Trainer does for its model: `every_n_layers` and `offload` are its own keys, the rest goes to torch.
        kwargs = dict(args.gradient_checkpointing_kwargs or {})
        every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        base = model.get_base_model()
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(
                activation_checkpointing_kwargs=kwargs or None, every_n_layers=every_n_layers, offload=offload
            )
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        for name, param in model.named_parameters():
            if param.requires_grad and "lora_magnitude_vector" not in name:
                param.data = param.data.to(torch.bfloat16)
    add_fused_lm_head(
        model.get_base_model(),
        temperature=temperature,
        cast_lm_head_to_fp32=args.cast_lm_head_to_fp32,
        outputs=("log_probs", "entropy"),
    )


def register_bases(first, others: Sequence[Any]) -> None:
    """Register the other bases' `PeftModel`s as a submodule of the first's (`TEAM_BASES`)."""
    if others:
        first.add_module(TEAM_BASES, torch.nn.ModuleList(others))


@contextmanager
def first_base_alone(model) -> Iterator[None]:
    """The first base without the others registered under it, for PEFT's `save_pretrained` of its adapters: PEFT picks
    an adapter's weights out of the whole model's state by name, and would save the other bases' adapters in the first
    base's adapter files."""
    others = model._modules.pop(TEAM_BASES, None)
    try:
        yield
    finally:
        if others is not None:
            model._modules[TEAM_BASES] = others


def save_base_adapters(folder: str | os.PathLike, base: TeamBase, adapters: Sequence[str]) -> None:
    """A base's adapters in PEFT format under `folder/<adapter>/`, each with the base's tokenizer beside it (the team's
    tokenizer at `folder`'s top is the first base's)."""
    from pathlib import Path

    base.model.save_pretrained(str(folder), selected_adapters=list(adapters))
    for adapter in adapters:
        base.tokenizer.save_pretrained(str(Path(folder) / adapter))


def load_base_adapters(checkpoint: str | os.PathLike, model, adapters: Sequence[str]) -> None:
    """Load a base's adapters from `checkpoint/<adapter>/` into the parameters the model already holds (in place, in
    their own dtype: the optimizer and the router hold them). Raises `ValueError` naming the adapter and the first key
    when the folder holds weights the adapter does not have, or lacks some of its own: LoRA weights (`is_adapter_key`),
    which would otherwise keep their fresh, untrained values, or a module it trains whole (`modules_to_save`, which
    PEFT looks up by its saved key)."""
    from pathlib import Path

    from peft.utils import load_peft_weights, set_peft_model_state_dict

    device = next(model.parameters()).device
    for adapter in adapters:
        folder = Path(checkpoint) / adapter
        weights = load_peft_weights(str(folder), device=str(device))
        try:
            result = set_peft_model_state_dict(model, weights, adapter_name=adapter)
        except KeyError as error:  # PEFT looks up a module trained whole (`modules_to_save`) by its saved key
            key = error.args[0] if error.args else None
            if not isinstance(key, str) or key in weights or not key.startswith("base_model."):
                raise
            raise ValueError(
                f"{folder}: weights of the adapter '{adapter}' are missing, the first {key}. The folder was saved "
                "from another configuration or is incomplete: load a complete save of this team."
            ) from error
        if result.unexpected_keys:
            raise ValueError(
                f"{folder} holds weights the adapter '{adapter}' does not have "
                f"({result.unexpected_keys[:3]}...): it was saved from another model or LoRA configuration."
            )
        # Every parameter the checkpoint does not set is "missing", the base model's too: only this adapter's count.
        missing = [key for key in result.missing_keys if is_adapter_key(key, adapter)]
        if missing:
            raise ValueError(
                f"{folder}: {len(missing)} weights of the adapter '{adapter}' are missing, the first "
                f"{missing[0]}; they would keep their fresh, untrained values. The folder was saved from another LoRA "
                "configuration (other target modules or layers) or is incomplete: load a complete save of this team."
            )


def saved_adapters_model(model, folder: str | os.PathLike, adapters: Sequence[str]):
    """`model` (a loaded base) as a `PeftModel` carrying the saved `adapters` (`folder/<adapter>/`), each built from
    its own `adapter_config.json` (rank and alpha, their per-module patterns, rsLoRA, biases, targets) and loaded as a
    checkpoint's adapters are (`load_base_adapters`: missing or unexpected weights refused), in the dtype it was saved
    in; in eval mode. `load_team` loads a saved team's bases with it, and `evaluate_task` through `load_team`'s
    loading."""
    from pathlib import Path

    from peft import PeftConfig, get_peft_model

    configs = [PeftConfig.from_pretrained(str(Path(folder) / adapter)) for adapter in adapters]
    for config in configs:
        # The saved configs name the base as team.json records it (`./<folder>`, the default model's Hub id); the
        # adapters are rebuilt on the base as loaded here, so PEFT's "renamed base model" warning would be noise.
        config.base_model_name_or_path = getattr(model, "name_or_path", None) or None
    model = get_peft_model(model, configs[0], adapter_name=adapters[0])
    for adapter, config in zip(adapters[1:], configs[1:]):
        model.add_adapter(adapter, config)
    load_base_adapters(folder, model, adapters)
    for adapter in adapters:
        keep_saved_dtype(model, adapter, Path(folder) / adapter)
    return model.eval()


def keep_saved_dtype(model, adapter: str, folder: str | os.PathLike) -> None:
    """Give an adapter's weights the dtype they were saved (trained) in. TRL trains adapters in bf16 on a quantized
    base; PEFT creates them in the base's dtype, and the replay would then round differently."""
    from pathlib import Path

    from safetensors import safe_open

    weights = Path(folder) / "adapter_model.safetensors"
    if not weights.is_file():
        return
    with safe_open(str(weights), framework="pt") as saved:
        dtype = saved.get_slice(next(iter(saved.keys()))).get_dtype()
    dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(dtype)
    for name, param in model.named_parameters():
        if dtype is not None and is_adapter_key(name, adapter):
            param.data = param.data.to(dtype)


def is_adapter_key(key: str, adapter: str) -> bool:
    """Whether the parameter or state-dict key `key` is one of `adapter`'s LoRA weights: the adapter's name is the
    path component right after a `lora_*` module (`...q_proj.lora_A.<adapter>.weight`,
    `...embed_tokens.lora_embedding_A.<adapter>`), never a part of the name elsewhere (every key holds `.model.`)."""
    return re.search(rf"\.lora_\w+\.{re.escape(adapter)}(\.|$)", key) is not None
