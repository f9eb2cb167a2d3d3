"""`evaluate_task`: a saved team and the paper's baselines (single agent, parallel, sequential) on a task's split."""

import json
import subprocess
import sys

import pytest

from trl_marl import MAGRPOConfig, MAGRPOTrainer
from trl_marl.cli import main
from trl_marl.cli.evaluation import evaluate_task

SMALL = dict(max_completion_length=4, use_cpu=True, seed=0)


@pytest.mark.parametrize(("baseline", "rows"), [("parallel", 2 * 6), ("sequential", 2 * 6), ("single", 1 * 2)])
def test_baselines_score_the_tasks_metrics(tiny_model_dir, baseline, rows):
    metrics = evaluate_task("reach_target", baseline, model=tiny_model_dir, limit=2, **SMALL)
    assert 0.0 <= metrics["reward"] <= 1.0
    # Per prompt (2 copies): two agents over a 2-turn tree of 2 + 4 joint actions, or one agent for one turn.
    assert metrics["num_samples"] == rows
    if baseline != "single":
        assert "turns/1/reward" in metrics


def test_the_metrics_leave_out_what_only_training_has(tiny_model_dir):
    metrics = evaluate_task("reach_target", "parallel", model=tiny_model_dir, limit=2, **SMALL)
    # trainer.evaluate() logs these too: the loss, PPO clipping, the advantages, the epoch, training tokens seen.
    assert not [key for key in metrics if key in ("loss", "epoch", "num_tokens") or key.startswith("clip_ratio/")]
    assert not [key for key in metrics if "advantage" in key]
    kept = (
        "reward reward_std rewards/reach_target_reward/mean completions/mean_length num_samples entropy runtime "
        "agents/mover/completion_length agents/mover/local_reward turns/1/reward"
    ).split()
    assert [key for key in kept if key not in metrics] == []


def test_a_saved_team_is_evaluated_as_trained(tiny_model_dir, tmp_path):
    args = MAGRPOConfig.for_task(
        "reach_target", output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_steps=1,
        report_to="none", save_strategy="no", **SMALL,
    )  # fmt: skip
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, task="reach_target")
    trainer.train()
    trainer.save_model(str(tmp_path / "team"))
    metrics = evaluate_task("reach_target", "team", team=tmp_path / "team", limit=2, **SMALL)
    assert metrics["num_samples"] == 12 and 0.0 <= metrics["reward"] <= 1.0


def test_bad_arguments_name_what_is_wrong(tiny_model_dir):
    with pytest.raises(ValueError, match="`baseline` must be one of"):
        evaluate_task("reach_target", "ensemble", model=tiny_model_dir)
    with pytest.raises(ValueError, match="Pass `team=`"):
        evaluate_task("reach_target", "team", model=tiny_model_dir)
    with pytest.raises(
        ValueError, match=r"`split` must be one of \['train', 'eval'\] \(a task's splits\), got 'test'"
    ):
        evaluate_task("reach_target", "parallel", model=tiny_model_dir, split="test")


@pytest.mark.slow
def test_the_evaluate_command_prints_the_metrics(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "trl_marl.cli", "evaluate", "reach_target", "--baseline", "single", "--model",
         tiny_model_dir, "--limit", "2", "--max_completion_length", "4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])
    assert report["baseline"] == "single" and report["num_samples"] == 2


def test_at_grpo_evaluation_plays_one_candidate_per_turn_and_reports_the_success_rate(tiny_model_dir):
    metrics = evaluate_task("reach_target", "parallel", model=tiny_model_dir, limit=2, algorithm="at_grpo", **SMALL)
    # One episode per problem, one candidate per agent and turn: 2 problems x 2 agents x 2 turns, and a success rate.
    assert metrics["num_samples"] == 2 * 2 * 2
    assert 0.0 <= metrics["episodes/success_rate"] <= 1.0
    with pytest.raises(ValueError, match="`algorithm` must be one of"):
        evaluate_task("reach_target", "parallel", model=tiny_model_dir, algorithm="ppo")


def saved_team(model_dir, folder, **generation):
    """An untrained two-agent reach_target team saved to `folder` with the generation settings `generation`."""
    args = MAGRPOConfig.for_task(
        "reach_target", output_dir=str(folder), per_device_train_batch_size=2, num_generations=2, max_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, seed=0, **generation,
    )  # fmt: skip
    MAGRPOTrainer(model_dir, args=args, task="reach_target").save_model(str(folder))
    return folder


RECORDED = dict(max_completion_length=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.1)


def test_a_saved_team_records_its_generation_settings_and_is_evaluated_with_them(tiny_model_dir, tmp_path):
    from trl_marl.cli.evaluation import team_settings

    team = saved_team(tiny_model_dir, tmp_path / "team", **RECORDED, chat_template_kwargs={"enable_thinking": False})
    spec = json.loads((team / "team.json").read_text())
    assert {key: spec[key] for key in RECORDED} == RECORDED
    settings = team_settings(spec)
    assert {key: settings[key] for key in RECORDED} == RECORDED
    assert settings["chat_template_kwargs"] == {"enable_thinking": False}
    older = {key: value for key, value in spec.items() if key not in RECORDED}  # a team.json from before these fields
    assert not set(RECORDED) & set(team_settings(older))  # the config's defaults stay


def test_evaluate_samples_as_the_team_recorded_unless_a_flag_says_otherwise(tiny_model_dir, tmp_path, monkeypatch):
    team = saved_team(tiny_model_dir, tmp_path / "team", **RECORDED)
    built = []
    monkeypatch.setattr(MAGRPOTrainer, "evaluate", lambda trainer, *a, **k: built.append(trainer.args) or {})
    command = ["evaluate", "reach_target", "--team", str(team), "--limit", "1"]
    assert main(command) == 0
    assert main([*command, "--max_completion_length", "6", "--temperature", "1.0", "--top_k", "0"]) == 0
    recorded, flagged = ({key: getattr(args, key) for key in RECORDED} for args in built)
    assert recorded == RECORDED  # not the command's former 256 tokens at temperature 1
    assert flagged == {**RECORDED, "max_completion_length": 6, "temperature": 1.0, "top_k": 0}


def test_a_baseline_still_samples_256_tokens_unless_told(tiny_model_dir, monkeypatch):
    built = []
    monkeypatch.setattr(MAGRPOTrainer, "evaluate", lambda trainer, *a, **k: built.append(trainer.args) or {})
    assert main(["evaluate", "reach_target", "--baseline", "single", "--model", tiny_model_dir, "--limit", "1"]) == 0
    assert built[0].max_completion_length == 256 and built[0].temperature == 1.0


def test_evaluate_task_takes_where_a_teams_base_is_and_says_so_when_it_cannot_find_it(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    import shutil
    from pathlib import Path

    team = saved_team(tiny_model_dir, tmp_path / "team")
    elsewhere = tmp_path / "elsewhere"  # the team on another machine: no path of the one that saved it
    shutil.copytree(team, elsewhere, ignore=shutil.ignore_patterns("_*"))
    built = []
    monkeypatch.setattr(MAGRPOTrainer, "evaluate", lambda trainer, *a, **k: built.append(trainer) or {})
    with pytest.raises(FileNotFoundError, match=r"base_model=.*to evaluate_task \(trl-marl evaluate: --base_model"):
        evaluate_task("reach_target", team=elsewhere, limit=1, use_cpu=True)
    evaluate_task("reach_target", team=elsewhere, base_model=tiny_model_dir, limit=1, use_cpu=True)
    recorded = f"./{Path(tiny_model_dir).name}"
    evaluate_task("reach_target", team=elsewhere, base_models={recorded: tiny_model_dir}, limit=1, use_cpu=True)
    command = ["evaluate", "reach_target", "--team", str(elsewhere), "--limit", "1"]
    assert main([*command, "--base_model", tiny_model_dir]) == 0
    assert main([*command, "--base_models", f"{recorded}={tiny_model_dir}"]) == 0
    loaded = [trainer.model.get_base_model().config._name_or_path for trainer in built]
    assert loaded == [tiny_model_dir] * 4
    assert main(command) == 2  # before any model loads
    assert "--base_model" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"`model` \(.*\) is the base model of a baseline.*pass `base_model=`"):
        evaluate_task("reach_target", team=elsewhere, model=tiny_model_dir, limit=1, use_cpu=True)
