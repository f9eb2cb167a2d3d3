"""A saved team away from the machine that trained it: base model names another machine can resolve, a team found by
Hub repo id as well as by folder, and the team's files gathered for an upload.

- `hub_base_model`: the base model as a Hub id for a model card's metadata (the embedded default model's Hub id
  rather than its local conversion; nothing for a local folder, as TRL).
- `make_adapter_configs_portable`: each adapter's `adapter_config.json` names the base model as `team.json` does,
  never the local conversion of the default model.
- `resolve_team_folder`: a local folder, or a Hub repo id fetched with `snapshot_download` (the Hub cache when
  offline), for `load_team`.
- `copy_team_files`: a checkpoint's team (adapter folders, `team.json`, the card) into the folder that
  `Trainer._push_from_checkpoint` uploads.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .models import DEFAULT_MODEL_ID, _hub_offline, is_default_model

TEAM_FILE = "team.json"
CARD_FILE = "README.md"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def hub_base_model(name_or_path: str | None) -> str | None:
    """The base model's Hub id, or None when it has none: the default model (by id, Hub snapshot or GGUF conversion)
    is `DEFAULT_MODEL_ID`; a local folder (or any path) is not a Hub id."""
    name = str(name_or_path or "")
    if not name:
        return None
    if is_default_model(name):
        return DEFAULT_MODEL_ID
    if os.path.isdir(name) or name.startswith(("/", ".", "~")):
        return None
    try:
        validate_repo_id(name)  # "name" or "org/name"
    except HFValidationError:
        return None
    return name


def make_adapter_configs_portable(folder: str | os.PathLike, adapters: list[str], base_model: str) -> None:
    """Set `base_model_name_or_path` of each adapter's `adapter_config.json` under `folder` to `base_model` (the name
    `team.json` records): PEFT writes the base's local path, which only resolves on the machine that trained it.

    The saved file is rewritten rather than PEFT's in-memory config changed: at save time PEFT looks the recorded name
    up (on the Hub for an id) to decide whether to save the embedding layers."""
    for adapter in adapters:
        path = Path(folder) / adapter / ADAPTER_CONFIG_FILE
        if not path.is_file():
            continue
        config = json.loads(path.read_text())
        if config.get("base_model_name_or_path") != base_model:
            config["base_model_name_or_path"] = base_model
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def resolve_team_folder(path_or_id: str | os.PathLike) -> Path:
    """The local folder of a saved team: `path_or_id` itself when it is a folder, else the snapshot of the Hub model
    repository of that id (`snapshot_download`; from the Hub cache only under `HF_HUB_OFFLINE`).

    Raises:
        FileNotFoundError: it is neither a folder nor a Hub repository that could be found; the message names it.
    """
    path = Path(path_or_id)
    if path.is_dir():
        return path
    name = str(path_or_id)
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise FileNotFoundError(
            f"No team at {name!r}: there is no such folder, and it is not a Hub repo id ('org/name'). Pass the folder "
            "written by save_model (the output_dir or a checkpoint-N folder) or the Hub id of a pushed team."
        ) from None
    offline = _hub_offline()
    try:
        return Path(snapshot_download(name, local_files_only=offline))
    except (OSError, ValueError) as error:  # not found, not cached offline, no network
        where = "in the Hugging Face Hub cache (offline mode is on)" if offline else "on the Hugging Face Hub"
        raise FileNotFoundError(
            f"No team at {name!r}: it is not a local folder, and no model repository {name!r} could be found {where} "
            f"({type(error).__name__}: {error}). Pass the folder written by save_model (the output_dir or a "
            "checkpoint-N folder) or the Hub id of a pushed team, e.g. load_team('org/team')."
        ) from error


def copy_team_files(source: str | os.PathLike, target: str | os.PathLike, adapters: list[str]) -> None:
    """Copy a saved team (each adapter's folder, `team.json`, the model card) from `source` into `target`."""
    source, target = Path(source), Path(target)
    for adapter in adapters:
        if (source / adapter).is_dir():
            shutil.copytree(source / adapter, target / adapter, dirs_exist_ok=True)
    for name in (TEAM_FILE, CARD_FILE):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
