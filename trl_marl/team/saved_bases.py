"""A saved team's bases on this machine: where each is found (`find_bases`: as the caller says, the kept local path, or
its recorded name) and how it loads (`saved_base_loading`: the caller's precision, else its agents' recorded one),
with its agents' adapters and its tokenizer (`load_saved_bases`). What `load_team` and `evaluate_task` load a team
with."""

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from ..agents import keep_4bit_weights_trainable
from ..precision import four_bit_config
from .bases import loadable, saved_adapters_model, spec_bases
from .hub import LOCAL_BASES_FILE, local_base_path

logger = logging.getLogger("trl_marl")


@dataclass
class SavedBase:
    """One base of a saved team, loaded: its name in `team.json`, where it was loaded from, its `PeftModel` (its
    agents' adapters), its tokenizer, its agents (indices) and whether it was quantized."""

    name: str
    source: str
    model: PeftModel
    tokenizer: Any
    agents: list[int]
    quantized: bool = False


def load_saved_bases(
    path: Path,
    spec: dict,
    *,
    load_in_4bit: bool | None = None,
    quantization_config: BitsAndBytesConfig | None = None,
    dtype: str | torch.dtype | None = None,
    device_map: Any = None,
    base_model: str | None = None,
    base_models: dict[str, str] | None = None,
) -> list[SavedBase]:
    """Each base of the saved team in `path` (`spec`: its team.json), the first agent's first: found (`find_bases`),
    loaded once (`saved_base_loading`: the caller's precision, else the one its agents recorded) with its agents'
    adapters, each from its own saved config (`bases.saved_adapters_model`), and its tokenizer (the first base's
    at the folder's top, another's beside its adapters). What `load_team` and `evaluate_task` load a team with."""
    groups = spec_bases(spec)
    sources = find_bases(path, spec, base_model, base_models)
    bases = []
    for index, ((name, agents), source) in enumerate(zip(groups.items(), sources)):
        recorded = spec["agents"][agents[0]]  # agents on one base trained with one loading (`plan_bases`)
        quantization, base_dtype = saved_base_loading(recorded, load_in_4bit, quantization_config, dtype)
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=base_dtype, quantization_config=quantization, device_map=device_map
        )
        adapters = list(dict.fromkeys(spec["agents"][agent]["adapter"] for agent in agents))
        model = saved_adapters_model(model, path, adapters)
        keep_4bit_weights_trainable(model)  # the 4-bit kernel training used, so greedy episodes replay exactly
        saved = path if index == 0 else path / adapters[0]
        tokenizer = AutoTokenizer.from_pretrained(saved if (saved / "tokenizer_config.json").is_file() else source)
        bases.append(SavedBase(name, source, model, tokenizer, agents, quantization is not None))
    return bases


def saved_base_loading(
    agent: dict, load_in_4bit: bool | None, quantization_config: BitsAndBytesConfig | None, dtype
) -> tuple[BitsAndBytesConfig | None, Any]:
    """A saved base's quantization config and dtype. The caller's `quantization_config` / `load_in_4bit` and `dtype`,
    when given, apply to every base; else the base loads as its agent (`agent`, its team.json entry) recorded its own
    model's loading (`load_in_4bit`, `dtype`), as the trainer loaded it; else unquantized in the checkpoint's dtype."""
    if quantization_config is None:
        four_bit = agent.get("load_in_4bit", False) if load_in_4bit is None else load_in_4bit
        quantization_config = four_bit_config() if four_bit else None
    return quantization_config, agent.get("dtype", "auto") if dtype is None else dtype


def find_bases(
    path: Path, spec: dict, base_model: str | None = None, base_models: dict[str, str] | None = None
) -> list[str]:
    """Where each base of the saved team (`spec_bases`, the first agent's first) loads from here: as the caller says
    (`base_model` for the first, `base_models` by recorded name), else the local folder the saving machine kept it in
    (`hub.local_base_path`), else its recorded name (a Hub id, the embedded default model, or `./<folder>` in the
    working directory; a warning names both when the kept folder is gone and the working directory's is loaded
    instead).

    Raises:
        ValueError: `base_models` names no base of the team.
        FileNotFoundError: some bases cannot be found; the message names each, its agents, the kept path it tried,
            and the `base_model=` / `base_models=` to pass to `load_team` or `evaluate_task`.
    """
    groups = spec_bases(spec)
    base_models = dict(base_models or {})
    unknown = [name for name in base_models if name not in groups]
    if unknown:
        raise ValueError(
            f"`base_models` names {unknown}, but the team in {path} sits on {list(groups)} (the names its team.json "
            "records). Key each model by one of those."
        )
    sources, missing = [], []
    for index, (name, agents) in enumerate(groups.items()):
        who = ", ".join(f"'{spec['agents'][agent]['name']}'" for agent in agents)
        given = base_model if index == 0 and base_model else base_models.get(name)
        kept = None if given else local_base_path(path, name)
        kept_here = kept is not None and os.path.isdir(kept)
        source = loadable(given or (kept if kept_here else name))
        in_working_directory = not given and not kept_here and name.startswith("./") and os.path.isdir(name)
        if kept is not None and in_working_directory:
            logger.warning(
                f"The team in {path} kept its base {name!r} (the base of {who}) at {kept} ({LOCAL_BASES_FILE}), which "
                f"does not exist any more; loading {os.path.abspath(name)} from the working directory instead. Pass "
                f"base_model= / base_models={{{name!r}: ...}} to load_team or evaluate_task to choose the base."
            )
        try:
            AutoConfig.from_pretrained(source)  # config.json alone: found before any weights load
        except (OSError, ValueError) as error:
            reason = " ".join(str(error).split())[:160].rstrip(".")
            if given:
                where = f"not at {source!r} ({reason})"
            elif kept_here:
                where = f"the kept path {kept!r} ({LOCAL_BASES_FILE}) holds no model ({reason})"
            elif name.startswith("./"):  # a local base, recorded by its folder's name
                tried = f"the kept path {kept!r} ({LOCAL_BASES_FILE}) does not exist, and " if kept else ""
                found = f"holds no model ({reason})" if in_working_directory else "does not exist"
                where = f"{tried}the working directory's {name!r} ({os.path.abspath(name)}) {found}"
            else:
                where = f"not found ({reason})"
            missing.append((index, name, f"{name!r} (the base of {who}): {where}"))
        sources.append(source)
    if missing:
        placeholder = {name: f"'/path/to/{Path(name).name}'" for _, name, _ in missing}
        first = [f"base_model={placeholder[name]}" for index, name, _ in missing if index == 0]
        others = [f"{name!r}: {placeholder[name]}" for index, name, _ in missing if index > 0]
        say = [*first, *([f"base_models={{{', '.join(others)}}}"] if others else [])]
        keywords = " and ".join(keyword.split("=")[0] + "=" for keyword in say)
        raise FileNotFoundError(
            f"The team in {path} sits on base models that cannot be found here: "
            f"{'; '.join(text for _, _, text in missing)}. team.json names a base by its Hub id, or a local one by "
            "its folder's name ('./<folder>'), which the machine that saved the team finds, or a working directory "
            "holding that folder. Say where each is on this machine (a folder or a Hub id): "
            f"load_team({', '.join([repr(str(path)), *say])}), or the same {keywords} to evaluate_task "
            "(trl-marl evaluate: --base_model, --base_models NAME=PATH)."
        )
    return sources
