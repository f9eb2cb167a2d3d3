"""The team's model card (Hub id of the base, agents and roles, the right paper, settings and metrics, snippets that
run) and portable adapter configs. Pushing and loading by Hub id: tests/test_team_hub.py."""

import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
import trl
from datasets import Dataset
from huggingface_hub import ModelCard
from tiny_run import TINY_RUN

from trl_marl import (
    DEFAULT_MODEL_ID,
    ATGRPOConfig,
    ATGRPOTrainer,
    MAGRPOConfig,
    MAGRPOTrainer,
    default_model_path,
)
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
        **TINY_RUN,
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
    assert 'load_team("out/checkpoint-1")' in card.text


def test_the_cards_load_team_snippet_runs(default_team, capsys, monkeypatch):
    _, out = default_team
    snippet = next(block for block in python_blocks((out / "README.md").read_text()) if "load_team" in block)
    assert 'load_team("out")' in snippet  # the saved folder's name: run from its parent, nothing to substitute
    monkeypatch.chdir(out.parent)
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


@pytest.mark.parametrize("team", ["default_team", "tiny_team"])
def test_the_card_names_the_teams_folder_never_a_path_of_this_machine(team, request, tiny_model_dir):
    _, out = request.getfixturevalue(team)
    machine_paths = [str(out), str(out.parent), tiny_model_dir, default_model_path(), tempfile.gettempdir()]
    # The folder's name, as TRL's cards name a model; a checkpoint's inside it.
    cards = {out / "README.md": "out", out / "checkpoint-1" / "README.md": "out/checkpoint-1"}
    for card, name in cards.items():
        if card.exists():  # the tiny team saves no checkpoint
            text = card.read_text()
            assert [path for path in machine_paths if path in text] == [], card
            assert f'load_team("{name}")' in text and f'folder = "{name}"' in text


def test_a_team_on_a_local_base_omits_base_model_and_says_how_to_load_it(tiny_team, tiny_model_dir):
    _, out = tiny_team
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model is None and not any(tag.startswith("base_model:") for tag in card.data.tags)
    assert "None" not in card.content and "pass `base_model=`" in card.text
    assert "| `planner` | Plan briefly \\| in steps. | `planner/` |" in card.text  # a role's "|" escaped
    config = json.loads((out / "planner" / "adapter_config.json").read_text())
    # a local base: its folder's name, which another machine can pass again (`load_team(..., base_model=...)`)
    assert config["base_model_name_or_path"] == f"./{Path(tiny_model_dir).name}"


def test_the_cards_peft_snippet_loads_every_agents_adapter(tiny_team, tiny_model_dir, monkeypatch):
    trainer, out = tiny_team
    monkeypatch.chdir(out.parent)
    model = run_block(card_text(out), "PeftModel", local_base=tiny_model_dir)["model"]
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


# ---------------------------------------------------------------- what a card says, and snippets that run anywhere


def card_text(folder: Path) -> str:
    return (Path(folder) / "README.md").read_text()


def run_block(text: str, word: str, local_base: str | None = None) -> dict:
    """Execute the card's first Python block containing `word`; its namespace. `local_base`: the path of a local base
    model, which the card names by its folder's name only, put in its place as its user would."""
    block = next(block for block in python_blocks(text) if word in block)
    if local_base is not None:
        named = f'from_pretrained("{Path(local_base).name}")'
        assert named in block, block
        block = block.replace(named, f"from_pretrained({local_base!r})")
    namespace = {}
    exec(block, namespace)
    return namespace


def test_the_quick_start_of_a_task_team_plays_a_problem_of_the_task(tiny_model_dir, tmp_path, capsys, monkeypatch):
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
    monkeypatch.chdir(tmp_path)  # the snippet names the team by its folder's name, "out"
    namespace = {}
    exec(quick_start, namespace)  # as printed
    run = namespace["run"]
    assert set(run.final) == {"tool", "plan"}
    assert run.state is not None and namespace["row"]["puzzle"] == "plan_path"  # the puzzle's environment ran
    assert "tool: " in capsys.readouterr().out


def test_the_card_of_a_shared_adapter_says_all_agents_share_it(tiny_model_dir, tmp_path, monkeypatch):
    trainer = tiny_trainer(tiny_model_dir, tmp_path / "out", adapter_mode="shared")
    trainer.save_model()
    text = card_text(tmp_path / "out")
    assert "carrying one LoRA adapter (`team/`) that all 2 agents share." in text
    assert "All agents share one PEFT LoRA adapter, in the folder `team/`" in text
    assert "each answers with the shared adapter and its role" in text
    assert "adapter(s) shared" not in text and "in its own folder" not in text and "its own adapter" not in text
    assert "| `planner` | Plan briefly \\| in steps. | `team/` |" in text
    monkeypatch.chdir(tmp_path)
    assert set(run_block(text, "PeftModel", local_base=tiny_model_dir)["model"].peft_config) == {"team"}


def test_the_card_of_a_local_base_says_so_in_its_own_sentence(tiny_team, tiny_model_dir):
    _, out = tiny_team
    text = card_text(out)
    assert (
        f"The team is one base model, a local checkpoint (`{Path(tiny_model_dir).name}`), carrying one LoRA adapter "
        "per agent." in text
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


def test_snippets_load_a_folder_whose_name_holds_quotes_and_a_backslash(tiny_model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / 'Bob\'s "best" team \\ v1'
    trainer = tiny_trainer(tiny_model_dir, out)
    trainer.save_model()
    text = card_text(out)
    monkeypatch.chdir(tmp_path)
    assert set(run_block(text, "load_team")["run"].final) == {"planner", "checker"}
    assert set(run_block(text, "PeftModel", local_base=tiny_model_dir)["model"].peft_config) == {"planner", "checker"}
    assert f"load_team({out.name!r})" in text


def test_a_printed_row_never_passes_a_column_as_one_of_team_runs_options():
    from trl_marl.team.team_card import _example_call

    assert _example_call({"prompt": "Plan.", "topic": "picnic"}) == "'Plan.', topic='picnic'"
    assert _example_call({"prompt": "Plan.", "num_turns": 3}) == "'Plan.'"  # not run(num_turns=3)
