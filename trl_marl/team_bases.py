"""A team on several base models: which agents sit on which base, each base loaded once, and a batch's rows handed
to their own base.

An `agents` entry may name its own `model` (a Hub id or a local folder) and that model's loading (`load_in_4bit`,
`dtype`); an agent that names none sits on the trainer's model. Agents on one base share one loaded model, one
`PeftModel` carrying one adapter per agent, one router and one captured decoder: a one-base team is exactly today's
team. A row never crosses bases: each base tokenizes its own agents' prompts with its own tokenizer and chat template,
generates them and computes their log-probs; everything agents exchange (transitions, the prompts of later turns) is
text.

In the trainer the first agent's base is TRL's model; every other base is registered as a submodule of it
(`TEAM_BASES`), so that what `Trainer` does to its model (the optimizer, gradient clipping, `zero_grad`, train and eval
modes, moves to a device) reaches every base's adapters exactly as it reaches the first base's. The trainer's
generation settings are the first base's: another base gets its own special tokens, and the first base's token ids in
other settings carried over by their text (`base_generation_config`). A saved team's base is rebuilt with each
adapter from its own saved config (`saved_adapters_model`), for `load_team` and `evaluate_task` alike.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.data_utils import is_conversational
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import create_model_from_path

from .agents import BASE_DTYPES
from .default_model import DEFAULT_MODEL_ID, default_model_path, is_default_model
from .hub import portable_base_name
from .routing import OTHER_BASES as TEAM_BASES  # the attribute of the first base's PeftModel holding the others

# The generation settings that hold token ids (nested lists of ids; `sequence_bias` maps id sequences to biases): the
# trainer's are the first base's ids, carried to another base by their text (`base_generation_config`).
TOKEN_ID_SETTINGS = (
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "force_words_ids",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
)


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
            from .precision import model_init_kwargs_for

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
                from .precision import four_bit_config

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


def other_base(
    plan: BasePlan,
    model,
    *,
    first_tokenizer,
    agent_adapters: Sequence[str],
    agent_names: Sequence[str],
    generation_config,
    captured: bool | str | None,
    chat_template_kwargs: dict,
    tools,
    pad_to_multiple_of: int | None,
    gradient_checkpointing_kwargs: dict | None,
    max_completion_length: int,
    profile: Callable,
) -> TeamBase:
    """A base other than TRL's model: its tokenizer, router, captured decoder (`captured`: the `captured_decode`
    setting, False for eager `generate`) and `TeamGeneration`, which tokenizes and generates as TRL does for its model
    (`tokenize_text_prompts`, `base_single_turn`) with this base's tokenizer, chat template and special tokens. Raises
    `ValueError` when one of the first base and this one has a chat template and the other has none."""
    from .captured_decode import captured_decoder
    from .routing import AdapterRouter
    from .team_generation import TeamGeneration, position_limit

    # A loaded base (`base_models`) has its tokenizer where the model was loaded from, as TRL finds the trainer's.
    loaded_from = plan.source if isinstance(plan.source, str) else model.get_base_model().config._name_or_path
    tokenizer = base_tokenizer(loaded_from)
    if (tokenizer.chat_template is None) != (first_tokenizer.chat_template is None):
        first = getattr(first_tokenizer, "name_or_path", "") or "the first base"
        with_template, without = (plan.name, first) if tokenizer.chat_template else (first, plan.name)
        raise ValueError(
            f"`agents`: {with_template} has a chat template and {without} has none, but one team's prompts are "
            "either conversations or plain text for every agent. Put the agents on bases that agree (e.g. both "
            "instruct models)."
        )
    router = AdapterRouter(model, [agent_adapters[i] for i in plan.agents])
    decoder = captured_decoder(model, router, captured) if captured is not False else None
    config = base_generation_config(generation_config, model, tokenizer, first_tokenizer)
    generation = TeamGeneration(
        router,
        agent_adapters,
        agent_names,
        tokenize=functools.partial(tokenize_text_prompts, tokenizer, chat_template_kwargs, tools),
        generate_single_turn=base_single_turn(
            model,
            decoder,
            tokenizer,
            config,
            pad_to_multiple_of=pad_to_multiple_of,
            gradient_checkpointing_kwargs=gradient_checkpointing_kwargs,
            profile=profile,
        ),
        processing_class=tokenizer,
        position_limit=position_limit(model.config, None),
        max_completion_length=max_completion_length,
    )
    eos_token_ids = list(config.eos_token_id)
    return TeamBase(plan.name, model, tokenizer, plan.agents, router, decoder, generation, eos_token_ids, plan.loading)


def base_tokenizer(name: str):
    """A base's tokenizer, prepared as TRL prepares the trainer's: its pad token falls back to its EOS."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(loadable(name), truncation_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def base_eos_token_ids(model, tokenizer) -> list[int]:
    """TRL's `eos_token_ids` for a base: its tokenizer's EOS first, then its generation config's."""
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return eos if tokenizer.eos_token_id in eos else [tokenizer.eos_token_id, *eos]


def base_generation_config(generation_config, model, tokenizer, first_tokenizer):
    """The trainer's generation config (the first base's, `first_tokenizer`'s ids) for another base: its own special
    tokens (pad, BOS, EOS), as TRL builds them for the trainer's model, and the first base's token ids in every other
    setting (`TOKEN_ID_SETTINGS`) carried over by their text (`carried_token_ids`): a single token as one token, a
    sequence (`bad_words_ids`, `force_words_ids`, `sequence_bias`'s keys) as a whole, however the other base splits
    its text. Raises `ValueError` naming the setting when a token or sequence cannot be carried, or for `constraints`,
    objects holding the first base's ids."""
    config = copy.deepcopy(generation_config)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = base_eos_token_ids(model, tokenizer)
    if getattr(config, "constraints", None):
        raise ValueError(
            "`constraints` hold the first base's token ids, which another base's tokenizer does not share, and a team "
            "on several bases cannot carry them over. Leave `constraints` out of `generation_kwargs`."
        )
    for setting in TOKEN_ID_SETTINGS:
        value = getattr(config, setting, None)
        if value is None:
            continue

        def token(token_id: int, setting=setting) -> int:
            return carried_token_ids([token_id], first_tokenizer, tokenizer, setting, one_token=True)[0]

        def sequences(value, setting=setting):  # a sequence of ids, or nested lists of sequences
            if all(isinstance(token_id, int) for token_id in value):
                return type(value)(carried_token_ids(value, first_tokenizer, tokenizer, setting))
            return type(value)(sequences(inner) for inner in value)

        if isinstance(value, int):  # forced_bos_token_id, forced_eos_token_id
            setattr(config, setting, token(value))
        elif setting in ("suppress_tokens", "begin_suppress_tokens", "forced_eos_token_id"):
            setattr(config, setting, type(value)(token(token_id) for token_id in value))
        elif setting == "sequence_bias" and isinstance(value, dict):
            setattr(config, setting, {sequences(ids): bias for ids, bias in value.items()})
        elif setting == "sequence_bias":  # [[ids, bias], ...]
            setattr(config, setting, [[sequences(ids), bias] for ids, bias in value])
        else:  # bad_words_ids, force_words_ids: lists of sequences (force_words_ids also lists of alternatives)
            setattr(config, setting, [sequences(ids) for ids in value])
    return config


# Short texts put before a token or sequence to read or write its text as it reads inside a text: a SentencePiece
# tokenizer (Llama-2, Mistral) drops the leading space of the first token it decodes ("▁the" alone decodes to "the")
# and adds one before the text it encodes. A tokenizer's anchor is the first of these that it writes and reads back
# exactly (a vocabulary without "\n" writes it as its unknown token).
ANCHOR_TEXTS = ("\n", "a", ".")


def anchors(tokenizer) -> list[list[int]]:
    """The ids of each of `ANCHOR_TEXTS` that `tokenizer` writes and reads back exactly."""
    found = []
    for text in ANCHOR_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ids and tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text:
            found.append(ids)
    return found


def text_of(tokenizer, ids: Sequence[int]) -> str | None:
    """The text `tokenizer` reads `ids` as inside a text (after its first anchor: leading spaces kept); None when it
    has no anchor or the anchor's text does not lead what it reads."""
    for anchor in anchors(tokenizer)[:1]:
        prefix, text = tokenizer.decode(anchor), tokenizer.decode([*anchor, *ids])
        if text.startswith(prefix):
            return text[len(prefix) :]
    return None


def ids_of(tokenizer, text: str) -> list[int] | None:
    """The ids `tokenizer` writes `text` as inside a text (after an anchor, whose ids are taken off), read back as
    exactly `text` (`text_of`); None when no anchor gives that."""
    for anchor in anchors(tokenizer):
        ids = tokenizer.encode(tokenizer.decode(anchor) + text, add_special_tokens=False)
        if ids[: len(anchor)] == anchor and len(ids) > len(anchor) and text_of(tokenizer, ids[len(anchor) :]) == text:
            return ids[len(anchor) :]
    return None


def carried_token_ids(
    ids: Sequence[int], first_tokenizer, tokenizer, setting: str, one_token: bool = False
) -> list[int]:
    """The ids `tokenizer` writes the text of the sequence `ids` of `first_tokenizer` as: the text each tokenizer reads
    inside a text (`text_of`, `ids_of`: a SentencePiece token's leading space kept), which `first_tokenizer` writes as
    exactly `ids` and `tokenizer` reads back as exactly that text; with `one_token`, a single token. Raises
    `ValueError` naming `setting`, the ids and their text otherwise (a token the other base splits where one token is
    needed, a token that is no text on its own, such as part of a character)."""
    ids = list(ids)
    text = text_of(first_tokenizer, ids)
    carried = None if text is None else ids_of(tokenizer, text)
    exact = text is not None and ids_of(first_tokenizer, text) == ids and carried is not None
    if exact and (len(carried) == 1 or not one_token):
        return carried
    first = getattr(first_tokenizer, "name_or_path", "") or "the first base"
    other = getattr(tokenizer, "name_or_path", "") or "another base"
    what = f"token id {ids[0]}" if len(ids) == 1 else f"the token ids {ids}"
    if exact:
        written = f"writes as {carried}, not as one token: it holds single tokens"
    elif text is not None and carried is not None:
        written = "cannot carry exactly: the first base's tokenizer does not write that text as those ids"
    else:
        written = "cannot write as exactly that text"
    raise ValueError(
        f"`{setting}` holds {what} ({text!r}) of the first base's tokenizer ({first}), which the tokenizer of {other} "
        f"{written}; a team on several bases cannot carry it to that base. Remove it from "
        f"`generation_kwargs['{setting}']`, or put these agents on bases whose tokenizers share it."
    )


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


def tokenize_text_prompts(tokenizer, chat_template_kwargs: dict, tools, prompts: list):
    """TRL's `_tokenize_prompts` for text prompts, with a base's own tokenizer and chat template."""
    if is_conversational({"prompt": prompts[0]}):
        prompt_ids = tokenizer.apply_chat_template(
            conversation=prompts,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **chat_template_kwargs,
        )["input_ids"]
    else:
        prompt_ids = tokenizer(text=prompts)["input_ids"]
    return prompt_ids, None, {}


def base_single_turn(
    model,
    decoder,
    tokenizer,
    generation_config,
    *,
    pad_to_multiple_of: int | None,
    gradient_checkpointing_kwargs: dict | None,
    profile: Callable,
) -> Callable:
    """TRL's `_generate_single_turn` (text, without vLLM) for a base other than the trainer's: its prompts
    left-padded with its pad token, `generate` (or its captured decoder) with its special tokens, completions cut
    after its first EOS."""
    from .team_generation import completions_through_eos, left_padded

    eos_token_ids = list(generation_config.eos_token_id)

    def single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None or multimodal_fields:
            raise ValueError("A base other than the trainer's first generates text only.")
        device = next(model.parameters()).device
        input_ids, attention_mask = left_padded(prompt_ids, tokenizer.pad_token_id, pad_to_multiple_of, device)
        with (
            profile("transformers.generate"),
            disable_gradient_checkpointing(model, gradient_checkpointing_kwargs),
            torch.no_grad(),
        ):
            if decoder is not None:
                output = decoder.generate(input_ids, attention_mask, generation_config)
            else:
                output = model.generate(
                    input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
                )
        return completions_through_eos(output[:, input_ids.size(1) :], eos_token_ids), None

    return single_turn


def generate_by_base(
    bases: Sequence[TeamBase], agent_base: Sequence[int], model_inputs: list, agent_index: list[int], **kwargs
):
    """The rollouts' `generate` hook over several bases: each base's rows in one call of its own generation, the
    results back in row order (prompt ids, completion ids, texts)."""
    prompt_ids, completion_ids, texts = [None] * len(agent_index), [None] * len(agent_index), [None] * len(agent_index)
    for base_index, base in enumerate(bases):
        rows = [row for row, agent in enumerate(agent_index) if agent_base[agent] == base_index]
        if not rows:
            continue
        out = base.generation.generate(
            [model_inputs[row] for row in rows], [agent_index[row] for row in rows], **kwargs
        )
        for position, row in enumerate(rows):
            prompt_ids[row], completion_ids[row], texts[row] = out[0][position], out[1][position], out[2][position]
    return prompt_ids, completion_ids, texts


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


def logps_by_base(
    bases: Sequence[TeamBase],
    base_of_row: torch.Tensor,
    agent_index: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    routed_logps: Callable,
    logits_to_keep: int,
    batch_size: int,
    **kwargs,
):
    """TRL's `(log-probs, entropies, aux loss)` of a batch whose rows sit on several bases: each base's rows through
    its own model (`routed_logps(base_index, base, agent_index, input_ids, attention_mask, logits_to_keep,
    batch_size, **kwargs)`), with its own padding (another base's pad token may lie outside its vocabulary) and
    trimmed to its rows' longest prompt, then put back in row order (differentiably)."""
    logps = entropies = None
    aux_losses = []
    for index, base in enumerate(bases):
        rows = (base_of_row == index).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        ids, mask = input_ids[rows], attention_mask[rows]
        start = int(mask.argmax(dim=1).min())  # the left padding every row of this base has
        ids, mask = ids[:, start:].masked_fill(mask[:, start:] == 0, base.pad_token_id), mask[:, start:]
        part_logps, part_entropies, part_aux = routed_logps(
            index, base, agent_index[rows], ids, mask, logits_to_keep, batch_size, **kwargs
        )
        if logps is None:
            logps = part_logps.new_zeros((input_ids.size(0), *part_logps.shape[1:]))
            entropies = None if part_entropies is None else part_entropies.new_zeros(logps.shape)
        logps = logps.index_copy(0, rows, part_logps)
        if entropies is not None:
            entropies = entropies.index_copy(0, rows, part_entropies)
        if part_aux is not None:
            aux_losses.append(part_aux)
    return logps, entropies, torch.stack(aux_losses).mean() if aux_losses else None
