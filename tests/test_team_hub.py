"""A saved team on the Hub: `push_to_hub` and checkpoint pushes upload the whole team with its card; `load_team` by a
Hub repo id (offline, from a hand-built Hub cache) downloads only the team's files; the base model is named by a Hub id
another machine resolves."""

import json
import shutil
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.utils import filter_repo_objects
from test_team_card import HUB_ID, PROMPT, card_text, python_blocks, run_block, tiny_trainer

from trl_marl import DEFAULT_MODEL_ID, default_model_path, load_team
from trl_marl.team import hub
from trl_marl.team.hub import hub_base_model, team_download_patterns

# A team repo pushed with hub_strategy="checkpoint" / "all_checkpoints", beside a base model's files.
REPO_FILES = {
    "team.json": True,
    "README.md": True,
    "tokenizer.json": True,
    "tokenizer_config.json": True,
    "special_tokens_map.json": True,
    "chat_template.jinja": True,
    "vocab.json": True,
    "merges.txt": True,
    "planner/adapter_config.json": True,
    "planner/adapter_model.safetensors": True,
    "checker/adapter_config.json": True,
    "checker/adapter_model.safetensors": True,
    "checkpoint-1/optimizer.pt": False,
    "checkpoint-1/trainer_state.json": False,
    "checkpoint-1/team.json": False,
    "checkpoint-1/planner/adapter_model.safetensors": False,
    "last-checkpoint/scheduler.pt": False,
    "last-checkpoint/checker/adapter_config.json": False,
    "training_args.bin": False,
    "model.safetensors": False,
    "runs/Jan01_00-00-00/events.out.tfevents.1.host": False,
}


def capture_hub_uploads(monkeypatch, tmp_path) -> list[dict]:
    """Stand-ins for the Hub calls `Trainer` makes (`create_repo`, `upload_folder`): each upload's files, filtered as
    the Hub client filters them, are copied aside at the time of the call."""
    uploads = []

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, *, repo_id, folder_path, ignore_patterns=None, run_as_future=False, **kwargs):
        folder = Path(folder_path)
        files = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
        files = sorted(filter_repo_objects(files, ignore_patterns=ignore_patterns))
        copy = tmp_path / f"upload-{len(uploads)}"
        for name in files:
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(folder / name, copy / name)
        uploads.append({"repo_id": repo_id, "files": files, "copy": copy, **kwargs})
        if run_as_future:
            future = Future()
            future.set_result(None)
            return future
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0")

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    return uploads


def put_in_hub_cache(monkeypatch, cache: Path, repo_id: str, files: Path | None) -> None:
    """A Hub cache at `cache` (the layout `snapshot_download` reads) holding `files` as `repo_id`'s main revision."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    if files is None:
        cache.mkdir(parents=True, exist_ok=True)
        return
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(files, repo / "snapshots" / commit)


@pytest.mark.parametrize(
    "name, hub_id",
    [("org/name", "org/name"), (DEFAULT_MODEL_ID, DEFAULT_MODEL_ID), ("/no/such/folder", None), ("", None)],
)
def test_hub_base_model_is_a_resolvable_id_or_nothing(name, hub_id):
    assert hub_base_model(name) == hub_id


def test_hub_base_model_of_the_local_default_model_is_its_hub_id_and_of_another_folder_nothing(tiny_model_dir):
    assert hub_base_model(default_model_path()) == DEFAULT_MODEL_ID
    assert hub_base_model(tiny_model_dir) is None


@pytest.fixture(scope="module")
def pushed_team(tiny_model_dir, tmp_path_factory):
    """A tiny team trained one step and pushed to `HUB_ID` through stand-ins of the Hub calls."""
    folder = tmp_path_factory.mktemp("pushed")
    with pytest.MonkeyPatch.context() as monkeypatch:
        uploads = capture_hub_uploads(monkeypatch, folder)
        trainer = tiny_trainer(tiny_model_dir, folder / "out", hub_model_id=HUB_ID)
        trainer.train()
        trainer.push_to_hub()
    return trainer, uploads


def test_push_to_hub_uploads_the_whole_team_with_its_card(pushed_team):
    trainer, uploads = pushed_team
    assert len(uploads) == 1 and uploads[0]["repo_id"] == HUB_ID
    files = set(uploads[0]["files"])
    for adapter in ("planner", "checker"):
        assert {f"{adapter}/adapter_config.json", f"{adapter}/adapter_model.safetensors"} <= files
    assert {"team.json", "README.md", "tokenizer.json", "tokenizer_config.json"} <= files
    uploaded = uploads[0]["copy"]
    assert [agent["name"] for agent in json.loads((uploaded / "team.json").read_text())["agents"]] == [
        "planner",
        "checker",
    ]
    card = ModelCard.load(uploaded / "README.md")
    assert card.data.model_name == "picnic-team" and "trl-marl" in card.data.tags
    assert f'load_team("{HUB_ID}")' in card.text and "snapshot_download(  # the adapters" in card.text
    allow, ignore = team_download_patterns(["planner", "checker"])
    assert f'    "{HUB_ID}",\n    allow_patterns={allow!r},\n    ignore_patterns={ignore!r},\n)' in card.text


def test_a_pushed_team_names_its_local_base_by_its_folders_name_only(pushed_team, tiny_model_dir):
    _, uploads = pushed_team
    uploaded = uploads[0]["copy"]
    recorded = f"./{Path(tiny_model_dir).name}"
    assert json.loads((uploaded / "team.json").read_text())["base_model"] == recorded
    for adapter in ("planner", "checker"):
        config = json.loads((uploaded / adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == recorded
    path = tiny_model_dir.encode()
    assert [name for name in uploads[0]["files"] if path in (uploaded / name).read_bytes()] == []
    assert "_local_bases.json" not in uploads[0]["files"]  # this machine's path of the base stays here


def in_the_bases_parent_folder(monkeypatch, tiny_model_dir) -> None:
    """Work where the local base's folder is, as another machine's user would (team.json names it `./<folder>`)."""
    monkeypatch.chdir(Path(tiny_model_dir).parent)


def test_load_team_by_hub_id_plays_an_episode_offline_from_the_hub_cache(
    pushed_team, tmp_path, monkeypatch, tiny_model_dir
):
    trainer, uploads = pushed_team
    put_in_hub_cache(monkeypatch, tmp_path / "hub", HUB_ID, uploads[0]["copy"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    in_the_bases_parent_folder(monkeypatch, tiny_model_dir)
    from_hub = load_team(HUB_ID).run(PROMPT)
    from_folder = load_team(trainer.args.output_dir).run(PROMPT)
    assert set(from_hub.final) == {"planner", "checker"}
    assert from_hub.final == from_folder.final  # the same adapters, greedy


def test_the_pushed_cards_load_team_snippet_runs_from_the_hub_cache(
    pushed_team, tmp_path, monkeypatch, capsys, tiny_model_dir
):
    _, uploads = pushed_team
    put_in_hub_cache(monkeypatch, tmp_path / "hub", HUB_ID, uploads[0]["copy"])
    in_the_bases_parent_folder(monkeypatch, tiny_model_dir)
    card_text = (uploads[0]["copy"] / "README.md").read_text()
    snippet = next(block for block in python_blocks(card_text) if "load_team" in block)
    namespace = {}
    exec(snippet, namespace)  # unchanged: load_team("org/picnic-team")
    assert set(namespace["run"].final) == {"planner", "checker"}
    assert "planner: " in capsys.readouterr().out


def test_load_team_names_the_id_it_cannot_find(tmp_path, monkeypatch):
    put_in_hub_cache(monkeypatch, tmp_path / "hub", "org/missing-team", None)
    with pytest.raises(FileNotFoundError, match=r"No team at 'org/missing-team'.*offline"):
        load_team("org/missing-team")


def test_load_team_on_a_missing_folder_says_it_is_neither_a_folder_nor_a_hub_id(tmp_path):
    missing = tmp_path / "no" / "such" / "team"
    with pytest.raises(FileNotFoundError, match=r"no such folder, and it is not a Hub repo id"):
        load_team(missing)


def test_checkpoint_pushes_upload_the_whole_team(tiny_model_dir, tmp_path, monkeypatch):
    uploads = capture_hub_uploads(monkeypatch, tmp_path)
    trainer = tiny_trainer(
        tiny_model_dir,
        tmp_path / "out",
        push_to_hub=True,
        hub_model_id=HUB_ID,
        hub_strategy="every_save",
        save_strategy="steps",
        save_steps=1,
    )
    trainer.train()
    checkpoint_push = next(u for u in uploads if u.get("commit_message", "").startswith("Training in progress"))
    files = set(checkpoint_push["files"])
    assert {"team.json", "README.md", "planner/adapter_model.safetensors", "checker/adapter_config.json"} <= files
    assert not any(name.startswith("checkpoint-") for name in files)
    assert f'load_team("{HUB_ID}")' in (checkpoint_push["copy"] / "README.md").read_text()


def test_a_team_repo_is_downloaded_without_its_checkpoints():
    allow, ignore = team_download_patterns(["planner", "checker"])
    kept = set(filter_repo_objects(REPO_FILES, allow_patterns=allow, ignore_patterns=ignore))
    assert kept == {path for path, needed in REPO_FILES.items() if needed}


def test_an_agent_named_like_a_checkpoint_keeps_its_adapter_folder():
    allow, ignore = team_download_patterns(["checkpoint-1"])
    files = ["checkpoint-1/adapter_model.safetensors", "last-checkpoint/optimizer.pt", "team.json"]
    assert list(filter_repo_objects(files, allow_patterns=allow, ignore_patterns=ignore)) == files[:1] + files[2:]


def test_load_team_by_hub_id_asks_only_for_the_team_files(pushed_team, tmp_path, monkeypatch, tiny_model_dir):
    _, uploads = pushed_team
    put_in_hub_cache(monkeypatch, tmp_path / "hub", HUB_ID, uploads[0]["copy"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    in_the_bases_parent_folder(monkeypatch, tiny_model_dir)
    calls = []

    def recording_snapshot_download(repo_id, **kwargs):
        calls.append(kwargs)
        return huggingface_hub.snapshot_download(repo_id, **kwargs)

    monkeypatch.setattr(hub, "snapshot_download", recording_snapshot_download)
    assert set(load_team(HUB_ID).run(PROMPT).final) == {"planner", "checker"}
    (call,) = calls
    assert call["revision"] == "0123456789abcdef0123456789abcdef01234567"  # the commit team.json came from
    kept = filter_repo_objects(
        REPO_FILES, allow_patterns=call["allow_patterns"], ignore_patterns=call["ignore_patterns"]
    )
    assert set(kept) == {path for path, needed in REPO_FILES.items() if needed}


def test_the_pushed_cards_peft_snippet_loads_from_the_hub_cache(pushed_team, tmp_path, monkeypatch, tiny_model_dir):
    _, uploads = pushed_team
    put_in_hub_cache(monkeypatch, tmp_path / "hub", HUB_ID, uploads[0]["copy"])
    model = run_block(card_text(uploads[0]["copy"]), "PeftModel", local_base=tiny_model_dir)["model"]
    assert set(model.peft_config) == {"planner", "checker"}


def test_load_team_of_a_hub_repo_without_team_json_says_it_is_not_a_team(tiny_model_dir, tmp_path, monkeypatch):
    put_in_hub_cache(monkeypatch, tmp_path / "hub", "org/base-model", Path(tiny_model_dir))  # a base model's repo
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"^'org/base-model' is not a trl_marl team: it has no team\.json"):
        load_team("org/base-model")


@pytest.mark.parametrize(
    "path, hub_id",
    [
        ("/root/.cache/huggingface/hub/models--Qwen--Qwen3-1.7B/snapshots/0123abcd", "Qwen/Qwen3-1.7B"),
        ("/cache/models--gpt2/snapshots/0123abcd/", "gpt2"),
        ("/cache/models--org--name/blobs/0123abcd", None),  # not a snapshot folder
    ],
)
def test_hub_base_model_of_a_hub_cache_snapshot_is_its_repo_id(path, hub_id):
    assert hub_base_model(path) == hub_id


def test_a_team_on_a_hub_cache_snapshot_records_the_repo_id(tiny_model_dir, tmp_path):
    snapshot = tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model_dir, snapshot)
    trainer = tiny_trainer(str(snapshot), tmp_path / "out")
    trainer.save_model()
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert card.data.base_model == "org/tiny-llama" and "base_model:adapter:org/tiny-llama" in card.data.tags
    assert json.loads((tmp_path / "out" / "team.json").read_text())["base_model"] == "org/tiny-llama"
    config = json.loads((tmp_path / "out" / "planner" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "org/tiny-llama"
    assert str(snapshot) not in card.text
