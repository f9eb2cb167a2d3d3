"""A saved team away from the machine that trained it: base model names another machine can resolve, a team found by
Hub repo id as well as by folder, and the team's files gathered for an upload.

- `hub_base_model`: the base model as a Hub id for a model card's metadata (the embedded default model's Hub id
  rather than its local conversion, a Hub cache snapshot's repo id; nothing for another local folder, as TRL).
- `portable_base_name`: the base model as `team.json` records it: its Hub id, else its local folder's name as a
  relative path (`./<folder>`), never a path of the machine that trained it; `write_local_bases` keeps that machine's
  paths of its local bases beside the team in a file that Trainer's uploads of the output folder leave out (a pushed
  checkpoint folder keeps it), where `local_base_path` finds them.
- `make_adapter_configs_portable`: each adapter's `adapter_config.json` names the base model as `team.json` does,
  never the local conversion of the default model.
- `resolve_team_folder`: a local folder, or a Hub repo id, for `load_team`: its `team.json` first (a repo without one
  is no team), then only the files a team needs (`team_download_patterns`: not its checkpoints), from the Hub cache
  when offline.
- `copy_team_files`: a checkpoint's team (adapter folders, `team.json`, the card) into the folder that
  `Trainer._push_from_checkpoint` uploads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from fnmatch import fnmatchcase
from pathlib import Path

from huggingface_hub import hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id

from .default_model import DEFAULT_MODEL_ID, _hub_offline, is_default_model

TEAM_FILE = "team.json"
CARD_FILE = "README.md"
# The local paths of a saved team's local bases on the machine that saved it (recorded name -> path). Trainer uploads
# the output folder (`push_to_hub`, each checkpoint push) without top-level names starting with "_", so the team pushed
# at the top of the repo leaves them out; but `hub_strategy="checkpoint"` / `"all_checkpoints"` also upload checkpoint
# folders whole, and `last-checkpoint/` or `checkpoint-N/` then holds this file, these paths included.
LOCAL_BASES_FILE = "_local_bases.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
# The top-level files of a team's repo that a team needs besides its adapter folders: `team.json`, the card, the
# tokenizer and chat template (`*.json`, `*.jinja`; `*.txt`, `*.model`, `*.tiktoken` for vocabularies). Patterns are
# matched as `huggingface_hub.utils.filter_repo_objects` does: `fnmatch` on the repo-relative path, `*` crossing `/`.
TEAM_TOP_LEVEL_PATTERNS = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken", CARD_FILE]
# Whole checkpoints (optimizer and scheduler states, every adapter again) that `hub_strategy="checkpoint"` or
# `"all_checkpoints"` pushes beside the team.
CHECKPOINT_PATTERNS = ["checkpoint-*/*", "last-checkpoint/*"]
# A Hub cache snapshot folder: `<cache>/models--<org>--<name>/snapshots/<commit>` (repo ids never hold "--").
_SNAPSHOT = re.compile(r"(?:^|[/\\])models--(?P<repo>[^/\\]+)[/\\]snapshots[/\\][^/\\]+[/\\]?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def hub_base_model(name_or_path: str | None) -> str | None:
    """The base model's Hub id, or None when it has none: the default model (by id, Hub snapshot or GGUF conversion)
    is `DEFAULT_MODEL_ID`; a Hub cache snapshot folder is its repo's id; another local folder (or any path) is not a
    Hub id."""
    name = str(name_or_path or "")
    if not name:
        return None
    if is_default_model(name):
        return DEFAULT_MODEL_ID
    if (snapshot_id := hub_snapshot_id(name)) is not None:
        return snapshot_id
    if os.path.isdir(name) or name.startswith(("/", ".", "~")):
        return None
    return name if _is_repo_id(name) else None


def portable_base_name(name_or_path: str | None) -> str:
    """A base model's name in `team.json` and the adapter configs, one that another machine can use: its Hub id
    (`hub_base_model`), else a local folder's name as a relative path, `./<folder>` (the `./` keeps it from being
    taken for a Hub id of that name)."""
    name = str(name_or_path or "")
    if not name:
        return name
    return hub_base_model(name) or f"./{Path(name).name}"


def write_local_bases(folder: str | os.PathLike, paths: dict[str, str]) -> None:
    """Record in `folder` where this machine keeps the team's local bases (`paths`: recorded name -> folder), so that
    `load_team` finds them here; without local bases the file is removed (a folder saved over keeps no stale one)."""
    path = Path(folder) / LOCAL_BASES_FILE
    if paths:
        path.write_text(json.dumps({name: os.path.abspath(local) for name, local in paths.items()}, indent=2) + "\n")
    elif path.is_file():
        path.unlink()


def local_base_path(folder: str | os.PathLike, name: str) -> str | None:
    """Where the machine that saved the team in `folder` kept its base recorded as `name` (`LOCAL_BASES_FILE`),
    whether or not that folder is here; None when the file records no path for it."""
    path = Path(folder) / LOCAL_BASES_FILE
    try:
        local = json.loads(path.read_text()).get(name)
    except (OSError, ValueError, AttributeError):
        return None
    return local if isinstance(local, str) else None


def hub_snapshot_id(path: str | os.PathLike) -> str | None:
    """The repo id of a Hub cache snapshot folder (`…/models--org--name/snapshots/<commit>` is "org/name"), else
    None."""
    match = _SNAPSHOT.search(str(path))
    if match is None:
        return None
    repo_id = match["repo"].replace("--", "/")
    return repo_id if _is_repo_id(repo_id) else None


def _is_repo_id(name: str) -> bool:
    try:
        validate_repo_id(name)  # "name" or "org/name"
    except HFValidationError:
        return False
    return True


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


def team_download_patterns(adapters: list[str]) -> tuple[list[str], list[str]]:
    """`snapshot_download`'s `allow_patterns` and `ignore_patterns` for a team repo whose adapter folders are
    `adapters`: the top-level files a team needs and those folders, never the checkpoints pushed beside them (a
    checkpoint pattern that would drop an adapter folder, such as an agent named "checkpoint-1", is left out)."""
    allow = [*TEAM_TOP_LEVEL_PATTERNS, *(f"{adapter}/*" for adapter in adapters)]
    ignore = [
        pattern
        for pattern in CHECKPOINT_PATTERNS
        if not any(fnmatchcase(f"{adapter}/{ADAPTER_CONFIG_FILE}", pattern) for adapter in adapters)
    ]
    return allow, ignore


def resolve_team_folder(path_or_id: str | os.PathLike) -> Path:
    """The local folder of a saved team: `path_or_id` itself when it is a folder, else the snapshot of the Hub model
    repository of that id (from the Hub cache only under `HF_HUB_OFFLINE`): its `team.json` first, then only what that
    names (`team_download_patterns`), at the commit the `team.json` came from.

    Raises:
        FileNotFoundError: it is neither a folder nor a Hub repository that could be found, or the repository has no
            `team.json`; the message names it.
    """
    path = Path(path_or_id)
    if path.is_dir():
        return path
    name = str(path_or_id)
    if not _is_repo_id(name):
        raise FileNotFoundError(
            f"No team at {name!r}: there is no such folder, and it is not a Hub repo id ('org/name'). Pass the folder "
            "written by save_model (the output_dir or a checkpoint-N folder) or the Hub id of a pushed team."
        )
    offline = _hub_offline()
    try:
        team_file = Path(hf_hub_download(name, TEAM_FILE, local_files_only=offline))
    except EntryNotFoundError as error:  # remote: the repo has no team.json; local: it or the whole repo is not cached
        from_cache = isinstance(error, LocalEntryNotFoundError)
        if from_cache and not _is_cached(name):
            raise _not_found(name, offline, error) from error
        where = " (in its snapshot in the Hub cache)" if from_cache else ""
        raise FileNotFoundError(
            f"{name!r} is not a trl_marl team: it has no {TEAM_FILE}{where}. Pass the Hub id of a team pushed by a "
            "trainer's push_to_hub (a base model's id goes to load_team's `base_model=`), or the folder written by "
            "save_model."
        ) from None
    except (OSError, ValueError) as error:  # no such repo, no network
        raise _not_found(name, offline, error) from error
    commit = team_file.parent.name if _COMMIT.match(team_file.parent.name) else None
    allow, ignore = team_download_patterns(_adapters_named(team_file))
    try:
        return Path(
            snapshot_download(
                name, revision=commit, local_files_only=offline, allow_patterns=allow, ignore_patterns=ignore
            )
        )
    except (OSError, ValueError) as error:
        raise _not_found(name, offline, error) from error


def _is_cached(name: str) -> bool:
    """Whether the Hub cache holds a snapshot of the model repo `name` (of any files)."""
    try:
        snapshot_download(name, local_files_only=True, allow_patterns=[TEAM_FILE])
    except (OSError, ValueError):
        return False
    return True


def _adapters_named(team_file: Path) -> list[str]:
    """The adapter folders `team_file` names; none when it cannot be read (`read_team_file` then says why)."""
    try:
        agents = json.loads(team_file.read_text())["agents"]
        return list(dict.fromkeys(str(agent["adapter"]) for agent in agents))
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _not_found(name: str, offline: bool, error: Exception) -> FileNotFoundError:
    where = "in the Hugging Face Hub cache (offline mode is on)" if offline else "on the Hugging Face Hub"
    return FileNotFoundError(
        f"No team at {name!r}: it is not a local folder, and no model repository {name!r} could be found {where} "
        f"({type(error).__name__}: {error}). Pass the folder written by save_model (the output_dir or a "
        "checkpoint-N folder) or the Hub id of a pushed team, e.g. load_team('org/team')."
    )


def copy_team_files(source: str | os.PathLike, target: str | os.PathLike, adapters: list[str]) -> None:
    """Copy a saved team (each adapter's folder, `team.json`, the model card) from `source` into `target`."""
    source, target = Path(source), Path(target)
    for adapter in adapters:
        if (source / adapter).is_dir():
            shutil.copytree(source / adapter, target / adapter, dirs_exist_ok=True)
    for name in (TEAM_FILE, CARD_FILE):
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
