"""The paper tasks' CPU recipes, end to end on the real default model, as a user runs them (subprocesses): a couple of
steps each, results printed and saved."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_helpers import require_bubblewrap

REPO = Path(__file__).resolve().parents[1]


def run_recipe(name, output_dir, *flags):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "recipes" / name), "--output_dir", str(output_dir), "--max_steps", "2",
               "--logging_steps", "1", *flags]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)


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


def test_coding_recipe_trains_with_the_sandbox_and_reports_pass_at_1(tmp_path, default_model_dir):
    require_bubblewrap()
    result = run_recipe("magrpo_coding.py", tmp_path, "--eval_problems", "2", "--max_completion_length", "24")
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["steps"] == 2
    for figures in (results["before"], results["after"]):
        assert -0.5 <= figures["team_reward"] <= 4.0 and 0.0 <= figures["pass_at_1"] <= 1.0
    assert (tmp_path / "helper" / "adapter_config.json").is_file()
