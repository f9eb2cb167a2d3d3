"""End to end on the real default model: the recipes run as a user runs them (subprocesses)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from peft import PeftModel
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "magrpo_quickstart.py"


def run_quickstart(output_dir, *flags, timeout=900):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(QUICKSTART), "--output_dir", str(output_dir), *flags]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


@pytest.mark.slow
def test_quickstart_trains_prints_and_saves_the_team(tmp_path, default_model_dir):
    result = run_quickstart(
        tmp_path, "--max_steps", "2", "--eval_questions", "2", "--max_completion_length", "8", "--logging_steps", "1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Team reward before training:" in result.stdout
    assert "Team reward after 2 steps:" in result.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 2
    assert 0.0 <= results["team_reward_before"] <= 1.0 and 0.0 <= results["team_reward_after"] <= 1.0
    for agent in ("concise", "detailed"):
        assert f"Adapter of agent '{agent}' saved in {tmp_path / agent}" in result.stdout
        assert (tmp_path / agent / "adapter_model.safetensors").is_file()
    team = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(default_model_dir), str(tmp_path / "concise"), adapter_name="concise"
    )
    team.load_adapter(str(tmp_path / "detailed"), adapter_name="detailed")
    assert set(team.peft_config) == {"concise", "detailed"}


@pytest.mark.slow
def test_quickstart_default_run_improves_the_team_reward(tmp_path):
    result = run_quickstart(tmp_path, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["team_reward_after"] > results["team_reward_before"]


MULTITURN = REPO / "recipes" / "magrpo_multiturn.py"


@pytest.mark.slow
def test_multiturn_recipe_trains_saves_and_replays_the_team(tmp_path, default_model_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    flags = ["--output_dir", str(tmp_path), "--max_steps", "1", "--eval_words", "2", "--max_completion_length", "6"]
    result = subprocess.run(
        [sys.executable, str(MULTITURN), *flags], capture_output=True, text=True, env=env, timeout=900, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Team reward per turn before training:" in result.stdout
    assert "Team reward per turn after 1 steps:" in result.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert len(results["team_reward_per_turn_before"]) == len(results["team_reward_per_turn_after"]) == 2
    assert all(0.0 <= r <= 1.0 for r in results["team_reward_per_turn_after"])
    # The reloaded team played both turns, every agent once per turn, and the episode was printed.
    assert [sorted(turn) for turn in results["episode"]["turns"]] == [["plain", "precise"]] * 2
    assert "turn 2 [precise]" in result.stdout
    team_file = json.loads((tmp_path / "team.json").read_text())
    assert team_file["transition"] == "trl_marl.tasks.toy:word_count_feedback"
    assert team_file["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
