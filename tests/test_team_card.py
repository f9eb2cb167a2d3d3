"""A saved team away from its machine: the team's model card (Hub id, agents and roles, the right paper, settings and
metrics, snippets that run), portable adapter configs, `load_team` from a Hub repo id (offline, from the Hub cache),
and `push_to_hub` / checkpoint pushes that upload the whole team."""

import json
import re
import shutil
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import trl
from datasets import Dataset
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.utils import filter_repo_objects

from trl_marl import (
    DEFAULT_MODEL_ID,
    ATGRPOConfig,
    ATGRPOTrainer,
    MAGRPOConfig,
    MAGRPOTrainer,
    default_model_path,
    hub,
    load_team,
)
from trl_marl.hub import hub_base_model, team_download_patterns
from trl_marl.tasks import resolve_task

AGENTS = [
    {"name": "planner", "system_prompt": "Plan briefly | in steps."},
    {"name": "checker", "system_prompt": "Check the plan."},
]
PROMPT = [{"role": "user", "content": "Plan a picnic."}]
HUB_ID = "org/picnic-team"


def different_lengths(prompts, completions, **kwargs):
    return [float(len(c["planner"]) - len(c["checker"])) for c in completions]


def tiny_config(output_dir, config_class=MAGRPOConfig, **overrides):
    values = dict(
        output_dir=str(output_dir),
        agents=AGENTS,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        learning_rate=5e-2,
        lora_r=4,
        lora_alpha=8,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=5,
    )
    return config_class(**{**values, **overrides})


def tiny_trainer(model_dir, output_dir, **overrides) -> MAGRPOTrainer:
    dataset = Dataset.from_dict({"prompt": [PROMPT, [{"role": "user", "content": "Plan a hike."}]]})
    args = tiny_config(output_dir, **overrides)
    trainer = MAGRPOTrainer(model_dir, different_lengths, args=args, train_dataset=dataset)
    # Fresh LoRA B is zero; different adapters make the agents (and a wrong adapter loaded) tell apart.
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return trainer


def python_blocks(card_text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", card_text, flags=re.DOTALL)


def table(card_text: str, section: str) -> dict[str, str]:
    """The two-column table (name -> value) of the card's `## <section>`."""
    text = card_text.split(f"\n## {section}\n")[1].split("\n## ")[0]
    return dict(re.findall(r"^\| `([^`]+)` \| ([^|]+) \|$", text, flags=re.MULTILINE))


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


# ---------------------------------------------------------------- a team on the default model


@pytest.fixture(scope="module")
def default_team(tmp_path_factory):
    """One MAGRPO step of the `explain` team on the real default model, saved (and checkpointed) as the CLI does."""
    out = tmp_path_factory.mktemp("default-team") / "out"
    task = resolve_task("explain")
    args = MAGRPOConfig.for_task(
        task,
        output_dir=str(out),
        max_steps=1,
        num_generations=2,
        per_device_train_batch_size=2,
        max_completion_length=6,
        learning_rate=3e-6,
        logging_steps=1,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        use_cpu=True,
    )
    trainer = MAGRPOTrainer(default_model_path(), args=args, task=task)
    trainer.train()
    trainer.save_model(str(out))
    return trainer, out


def test_the_card_of_a_default_model_team_names_its_hub_id_never_a_local_path(default_team):
    trainer, out = default_team
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == DEFAULT_MODEL_ID
    assert card.data.library_name == "peft"
    assert {"trl", "trl-marl", "magrpo", f"base_model:adapter:{DEFAULT_MODEL_ID}"} <= set(card.data.tags)
    assert default_model_path() not in card.content and "None" not in card.content
    assert f"[{DEFAULT_MODEL_ID}](https://huggingface.co/{DEFAULT_MODEL_ID})" in card.text


def test_the_card_lists_every_agent_with_its_role_and_adapter_folder(default_team):
    _, out = default_team
    text = (out / "README.md").read_text()
    agents = json.loads((out / "team.json").read_text())["agents"]
    assert len(agents) == 2
    for agent in agents:
        assert f"| `{agent['name']}` | {agent['system_prompt']} | `{agent['adapter']}/` |" in text
        assert (out / agent["adapter"] / "adapter_model.safetensors").is_file()


def test_the_magrpo_card_cites_the_magrpo_paper_not_deepseekmath(default_team):
    _, out = default_team
    text = (out / "README.md").read_text()
    assert "https://huggingface.co/papers/2508.04652" in text
    assert "LLM Collaboration With Multi-Agent Reinforcement Learning" in text
    assert "eprint       = {arXiv:2508.04652}" in text and "vonwerra2020trl" in text  # the method's and TRL's
    assert "2402.03300" not in text and "DeepSeekMath" not in text
    assert MAGRPOTrainer._paper["id"] == "2508.04652"


def test_the_card_records_the_training_settings_and_the_last_logged_metrics(default_team):
    trainer, out = default_team
    text = (out / "README.md").read_text()
    values = table(text, "Training procedure")
    assert values["algorithm"] == "MAGRPO" and values["task"] == "explain"
    assert values["num_generations"] == "2" and values["num_turns"] == "1"
    assert values["learning_rate"] == "3e-06" and values["global_step"] == "1" and values["max_steps"] == "1"
    assert values["lora_r"] == "16" and values["lora_alpha"] == "32"
    logged = [entry for entry in trainer.state.log_history if "reward" in entry][-1]
    metrics = table(text, "Results")
    assert metrics["reward"] == f"{logged['reward']:.4g}"
    assert metrics["agents/concise/completion_length"] == f"{logged['agents/concise/completion_length']:.4g}"
    assert f"Team reward at the last logged step ({logged['step']}): {logged['reward']:.4g}." in text
    assert f"- TRL: {trl.__version__}" in text and "- trl_marl: " in text


def test_adapter_configs_of_a_default_model_team_name_its_hub_id(default_team):
    trainer, out = default_team
    for folder in (out, out / "checkpoint-1"):
        for adapter in ("concise", "detailed"):
            config = json.loads((folder / adapter / "adapter_config.json").read_text())
            assert config["base_model_name_or_path"] == DEFAULT_MODEL_ID


def test_checkpoints_carry_the_team_card(default_team):
    _, out = default_team
    card = ModelCard.load(out / "checkpoint-1" / "README.md")
    assert card.data.base_model == DEFAULT_MODEL_ID and "None" not in card.content
    assert f'load_team("{out / "checkpoint-1"}")' in card.text


def test_the_cards_load_team_snippet_runs(default_team, capsys):
    _, out = default_team
    snippet = next(block for block in python_blocks((out / "README.md").read_text()) if "load_team" in block)
    assert f'load_team("{out}")' in snippet  # the saved folder, nothing to substitute
    namespace = {}
    exec(snippet, namespace)
    assert set(namespace["run"].final) == {"concise", "detailed"}
    printed = capsys.readouterr().out
    assert printed.startswith("concise: ") and "\ndetailed: " in printed


# ---------------------------------------------------------------- a tiny team (a local base model)


@pytest.fixture(scope="module")
def tiny_team(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-team") / "out"
    trainer = tiny_trainer(tiny_model_dir, out)
    trainer.train()
    trainer.save_model()
    return trainer, out


def test_a_team_on_a_local_base_omits_base_model_and_says_how_to_load_it(tiny_team, tiny_model_dir):
    _, out = tiny_team
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None and not any(tag.startswith("base_model:") for tag in card.data.tags)
    assert "None" not in card.content and "pass `base_model=`" in card.text
    assert "| `planner` | Plan briefly \\| in steps. | `planner/` |" in card.text  # a role's "|" escaped
    config = json.loads((out / "planner" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny_model_dir  # another base: its name or path as given


def test_the_cards_peft_snippet_loads_every_agents_adapter(tiny_team):
    trainer, out = tiny_team
    snippet = next(block for block in python_blocks((out / "README.md").read_text()) if "PeftModel" in block)
    namespace = {}
    exec(snippet, namespace)
    model = namespace["model"]
    assert set(model.peft_config) == {"planner", "checker"}
    trained = {name: p for name, p in trainer.model.named_parameters() if "lora_" in name}
    loaded = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert trained.keys() == loaded.keys() and len(trained) > 0
    assert all(torch.equal(trained[name].float(), loaded[name].float()) for name in trained)


def test_the_atgrpo_card_cites_the_atgrpo_paper(tiny_model_dir, tmp_path):
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 2})
    args = tiny_config(tmp_path / "out", ATGRPOConfig, per_device_train_batch_size=4)
    trainer = ATGRPOTrainer(tiny_model_dir, different_lengths, args=args, train_dataset=dataset)
    trainer.save_model()
    card = ModelCard.load(tmp_path / "out" / "README.md")
    assert "at-grpo" in card.data.tags and "magrpo" not in card.data.tags
    assert "https://huggingface.co/papers/2510.11062" in card.text and "eprint       = {arXiv:2510.11062}" in card.text
    assert "Stronger Together" in card.text and "2402.03300" not in card.text and "None" not in card.content
    assert "No training step has been logged yet." in card.text
    assert ATGRPOTrainer._paper["id"] == "2510.11062"


@pytest.mark.parametrize(
    "name, hub_id",
    [("org/name", "org/name"), (DEFAULT_MODEL_ID, DEFAULT_MODEL_ID), ("/no/such/folder", None), ("", None)],
)
def test_hub_base_model_is_a_resolvable_id_or_nothing(name, hub_id):
    assert hub_base_model(name) == hub_id


def test_hub_base_model_of_the_local_default_model_is_its_hub_id_and_of_another_folder_nothing(tiny_model_dir):
    assert hub_base_model(default_model_path()) == DEFAULT_MODEL_ID
    assert hub_base_model(tiny_model_dir) is None


# ---------------------------------------------------------------- sharing: push_to_hub, load_team from the Hub


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


def test_load_team_by_hub_id_plays_an_episode_offline_from_the_hub_cache(pushed_team, tmp_path, monkeypatch):
    trainer, uploads = pushed_team
    put_in_hub_cache(monkeypatch, tmp_path / "hub", HUB_ID, uploads[0]["copy"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from_hub = load_team(HUB_ID).run(PROMPT)
    from_folder = load_team(trainer.args.output_dir).run(PROMPT)
    assert set(from_hub.final) == {"planner", "checker"}
    assert from_hub.final == from_folder.final  # the same adapters, greedy


def test_the_pushed_cards_load_team_snippet_runs_from_the_hub_cache(pushed_team, tmp_path, monkeypatch, capsys):
    _, uploads = pushed_team
    put_in_hub_cache(monkeypatch, tmp_path / "hub", HUB_ID, uploads[0]["copy"])
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


# ---------------------------------------------------------------- what a card says, and snippets that run anywhere


def card_text(folder: Path) -> str:
    return (Path(folder) / "README.md").read_text()


def run_block(text: str, word: str) -> dict:
    """Execute the card's first Python block containing `word`; its namespace."""
    namespace = {}
    exec(next(block for block in python_blocks(text) if word in block), namespace)
    return namespace


def test_the_quick_start_of_a_task_team_plays_a_problem_of_the_task(tiny_model_dir, tmp_path, capsys):
    # plan_path's rows need their columns (`puzzle`, `board`): its environment's `reset` reads them. Its first training
    # row is too long to print, and a bare prompt is refused ("Task plan_path got a row of puzzle None").
    args = ATGRPOConfig.for_task(
        "plan_path",
        output_dir=str(tmp_path / "out"),
        num_turns=1,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        lora_r=4,
        lora_alpha=8,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    trainer = ATGRPOTrainer(tiny_model_dir, args=args, task="plan_path")
    trainer.save_model()
    text = card_text(tmp_path / "out")
    quick_start = python_blocks(text)[0]
    assert 'row = resolve_task("plan_path").dataset("eval")[0]' in quick_start and "team.play([row])" in quick_start
    assert "Explain why the sky is blue." not in quick_start
    namespace = {}
    exec(quick_start, namespace)  # as printed
    run = namespace["run"]
    assert set(run.final) == {"tool", "plan"}
    assert run.state is not None and namespace["row"]["puzzle"] == "plan_path"  # the puzzle's environment ran
    assert "tool: " in capsys.readouterr().out


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


def test_a_team_repo_is_downloaded_without_its_checkpoints():
    allow, ignore = team_download_patterns(["planner", "checker"])
    kept = set(filter_repo_objects(REPO_FILES, allow_patterns=allow, ignore_patterns=ignore))
    assert kept == {path for path, needed in REPO_FILES.items() if needed}


def test_an_agent_named_like_a_checkpoint_keeps_its_adapter_folder():
    allow, ignore = team_download_patterns(["checkpoint-1"])
    files = ["checkpoint-1/adapter_model.safetensors", "last-checkpoint/optimizer.pt", "team.json"]
    assert list(filter_repo_objects(files, allow_patterns=allow, ignore_patterns=ignore)) == files[:1] + files[2:]


def test_load_team_by_hub_id_asks_only_for_the_team_files(pushed_team, tmp_path, monkeypatch):
    _, uploads = pushed_team
    put_in_hub_cache(monkeypatch, tmp_path / "hub", HUB_ID, uploads[0]["copy"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
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


def test_the_pushed_cards_peft_snippet_loads_from_the_hub_cache(pushed_team, tmp_path, monkeypatch):
    _, uploads = pushed_team
    put_in_hub_cache(monkeypatch, tmp_path / "hub", HUB_ID, uploads[0]["copy"])
    model = run_block(card_text(uploads[0]["copy"]), "PeftModel")["model"]
    assert set(model.peft_config) == {"planner", "checker"}


def test_load_team_of_a_hub_repo_without_team_json_says_it_is_not_a_team(tiny_model_dir, tmp_path, monkeypatch):
    put_in_hub_cache(monkeypatch, tmp_path / "hub", "org/base-model", Path(tiny_model_dir))  # a base model's repo
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match=r"^'org/base-model' is not a trl_marl team: it has no team\.json"):
        load_team("org/base-model")


def test_the_card_of_a_shared_adapter_says_all_agents_share_it(tiny_model_dir, tmp_path):
    trainer = tiny_trainer(tiny_model_dir, tmp_path / "out", adapter_mode="shared")
    trainer.save_model()
    text = card_text(tmp_path / "out")
    assert "carrying one LoRA adapter (`team/`) that all 2 agents share." in text
    assert "All agents share one PEFT LoRA adapter, in the folder `team/`" in text
    assert "each answers with the shared adapter and its role" in text
    assert "adapter(s) shared" not in text and "in its own folder" not in text and "its own adapter" not in text
    assert "| `planner` | Plan briefly \\| in steps. | `team/` |" in text
    assert set(run_block(text, "PeftModel")["model"].peft_config) == {"team"}


def test_the_card_of_a_local_base_says_so_in_its_own_sentence(tiny_team, tiny_model_dir):
    _, out = tiny_team
    text = card_text(out)
    assert (
        f"The team is one base model, a local checkpoint (`{tiny_model_dir}`), carrying one LoRA adapter per agent."
        in text
    )
    assert "The base model is a local checkpoint with no Hub id: on another machine pass `base_model=`" in text
    assert "`load_team`, carrying" not in text


def test_the_atgrpo_card_describes_turn_taking_and_candidate_groups(tiny_model_dir, tmp_path):
    args = tiny_config(tmp_path / "out", ATGRPOConfig, team_reward_weight=0.5, num_turns=2)
    trainer = ATGRPOTrainer(
        tiny_model_dir, different_lengths, args=args, train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 2})
    )
    trainer.save_model()
    text = card_text(tmp_path / "out")
    assert "The agents act in turn (2 turns, scheduler `parallel`), each with its own adapter and its role." in text
    assert "at each step the acting agent sampled 2 candidates from the same state; they formed one group" in text
    assert "α · team reward (α = 0.5) + the agent's local reward, and the episode continued from the best one." in text
    assert "joint answer" not in text


def test_the_magrpo_card_says_one_team_reward_scores_the_joint_answer(tiny_team):
    _, out = tiny_team
    assert (
        "each answers with its own adapter and its role, and one team reward scores their joint answer"
        in card_text(out)
    )


def test_frozen_agents_are_marked_in_the_agents_table(tiny_model_dir, tmp_path):
    trainer = tiny_trainer(tiny_model_dir, tmp_path / "out", frozen_agents=["checker"])
    trainer.save_model()
    text = card_text(tmp_path / "out")
    assert "| `checker` (frozen) | Check the plan. | `checker/` |" in text
    assert "| `planner` | Plan briefly" in text  # trained: no mark
    assert "Frozen agents (`frozen_agents`: `checker`) acted in every training episode but did not train" in text


def test_the_last_evaluation_leaves_out_what_only_training_has(tiny_model_dir, tmp_path):
    trainer = tiny_trainer(tiny_model_dir, tmp_path / "out", per_device_eval_batch_size=2, num_generations_eval=2)
    trainer.evaluate(Dataset.from_dict({"prompt": [PROMPT] * 2}))
    logged = trainer.state.log_history[-1]
    assert {"eval_reward", "eval_loss", "eval_num_tokens"} <= set(logged)  # what evaluate() logs
    assert any(key.startswith("eval_clip_ratio/") for key in logged) and any("advantage" in key for key in logged)
    trainer.save_model()
    text = card_text(tmp_path / "out")
    evaluation = dict(re.findall(r"^\| `([^`]+)` \| ([^|]+) \|$", text.split("The last evaluation:")[1], re.MULTILINE))
    assert evaluation["eval_reward"] == f"{logged['eval_reward']:.4g}"
    assert "eval_agents/planner/completion_length" in evaluation and "eval_runtime" in evaluation
    assert not [key for key in evaluation if key in ("eval_loss", "eval_num_tokens") or "clip_ratio" in key]
    assert not [key for key in evaluation if "advantage" in key]


def test_snippets_load_a_folder_whose_name_holds_quotes_and_a_backslash(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / 'Bob\'s "best" team \\ v1'
    trainer = tiny_trainer(tiny_model_dir, out)
    trainer.save_model()
    text = card_text(out)
    assert set(run_block(text, "load_team")["run"].final) == {"planner", "checker"}
    assert set(run_block(text, "PeftModel")["model"].peft_config) == {"planner", "checker"}
    assert f"load_team({str(out)!r})" in text


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


def test_a_printed_row_never_passes_a_column_as_one_of_team_runs_options():
    from trl_marl.team_card import _example_call

    assert _example_call({"prompt": "Plan.", "topic": "picnic"}) == "'Plan.', topic='picnic'"
    assert _example_call({"prompt": "Plan.", "num_turns": 3}) == "'Plan.'"  # not run(num_turns=3)
