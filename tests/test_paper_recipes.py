"""The paper tasks' CPU recipes, end to end on the real default model, as a user runs them (subprocesses): a couple of
steps each, results printed and saved."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_helpers import require_bubblewrap

from trl_marl.cli.train import parse_train_config
from trl_marl.tasks import resolve_task

REPO = Path(__file__).resolve().parents[1]


def run_recipe(name, output_dir, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "recipes" / name), "--output_dir", str(output_dir), "--max_steps", "2",
               "--logging_steps", "1", *flags]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)


# Both run with the slow set (summaries 137 s, expansion 53 s alone): the default run keeps the coding recipe, which
# runs the same recipe code path (trainer, evaluation before and after, results.json), and the writing tasks' rewards
# and datasets are tested in test_writing.py.
@pytest.mark.slow
@pytest.mark.parametrize("task", ["summaries", "expansion"])
def test_writing_recipe_trains_and_reports_the_levels(tmp_path, default_model_dir, task):
    result = run_recipe(
        "magrpo_writing.py", tmp_path, "--task", task, "--eval_passages", "2", "--max_completion_length", "12"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["task"] == task and results["steps"] == 2
    for figures in (results["before"], results["after"]):
        assert 0.0 <= figures["team_reward"] <= 3.0
        assert set(figures) == {"team_reward", "structure", "coordination", "vocabulary", "style"}
    assert (tmp_path / "team.json").is_file()


@pytest.mark.slow
def test_coding_recipe_trains_with_the_sandbox_and_reports_pass_at_1(tmp_path, default_model_dir):
    require_bubblewrap()
    result = run_recipe("magrpo_coding.py", tmp_path, "--eval_problems", "2", "--max_completion_length", "24")
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 2
    for figures in (results["before"], results["after"]):
        assert -0.5 <= figures["team_reward"] <= 4.0 and 0.0 <= figures["pass_at_1"] <= 1.0
    assert (tmp_path / "helper" / "adapter_config.json").is_file()


PAPER_RECIPES = REPO / "recipes" / "paper"


@pytest.mark.parametrize(
    ("recipe", "task", "model", "turns", "temperature", "learning_rate"),
    [
        ("magrpo_tldr.yaml", "summaries", "Qwen/Qwen3-1.7B", 1, 0.7, 5e-6),
        ("magrpo_arxiv.yaml", "expansion", "Qwen/Qwen3-1.7B", 1, 0.7, 5e-6),
        ("magrpo_humaneval.yaml", "coop_coding_multiturn", "Qwen/Qwen2.5-Coder-3B", 2, 0.6, 2e-5),
    ],
)
def test_the_paper_scale_recipes_are_valid_configs_with_the_papers_settings(
    recipe, task, model, turns, temperature, learning_rate
):
    # bf16 needs a GPU; everything else is validated as `trl-marl train` validates it, without loading a model.
    script_args, args = parse_train_config(str(PAPER_RECIPES / recipe), ["--bf16", "false"])
    assert (script_args.algorithm, script_args.task, script_args.model_name_or_path) == ("magrpo", task, model)
    assert script_args.load_in_4bit
    assert args.agent_names == [agent["name"] for agent in resolve_task(task).agents]
    assert (args.num_generations, args.num_turns, args.joint_mode) == (4, turns, "aligned")
    assert (args.temperature, args.learning_rate, args.max_completion_length) == (temperature, learning_rate, 256)
    assert args.generation_batch_size % args.num_generations == 0


def test_cli_train_loads_a_4bit_base_and_passes_the_task_source(tiny_model_dir, tmp_path, monkeypatch):
    import bitsandbytes as bnb

    from trl_marl import MAGRPOTrainer
    from trl_marl.cli import main

    seen = {}
    original_train = MAGRPOTrainer.train

    def recording_train(trainer, *args, **kwargs):
        seen["linear4bit"] = sum(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
        seen["source"] = trainer.task.source
        return original_train(trainer, *args, **kwargs)

    monkeypatch.setattr(MAGRPOTrainer, "train", recording_train)
    config = tmp_path / "team.yaml"
    config.write_text(
        f"task: summaries\ntask_source: offline\nload_in_4bit: true\nmodel_name_or_path: {tiny_model_dir}\n"
        f"output_dir: {tmp_path / 'out'}\nper_device_train_batch_size: 2\nnum_generations: 2\n"
        "max_completion_length: 4\nmax_steps: 1\nreport_to: none\nsave_strategy: 'no'\nuse_cpu: true\n"
    )
    assert main(["train", str(config)]) == 0
    assert seen == {"linear4bit": seen["linear4bit"], "source": "offline"} and seen["linear4bit"] > 0
    assert (tmp_path / "out" / "concise" / "adapter_model.safetensors").is_file()
    with pytest.raises(TypeError, match=r"Task 'ReachTarget' does not take the options \['source'\]"):
        resolve_task("reach_target", source="hub")  # a task without data sources says so
