"""`evaluate_task`: a saved team and the paper's baselines (single agent, parallel, sequential) on a task's split."""

import json
import subprocess
import sys
from fractions import Fraction

import pytest
from datasets import Dataset
from test_tools import Notebook, add, scripted_writer
from transformers import AutoTokenizer

from trl_marl import MAGRPOConfig, MAGRPOTrainer, Task
from trl_marl.cli import main
from trl_marl.cli.evaluation import evaluate_task
from trl_marl.tasks.math_tool import TOOL, TOOL_PROMPT, math_prompt
from trl_marl.tasks.math_tool_calls import TOOL_CALLS_PROMPT, MathToolCalls, PythonRunner

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


# ------------------------------------------------------------------ a team with tools: evaluated as it trained


def words_written(prompts, completions, environments, **kwargs):
    return [float(len(environment.notes)) for environment in environments]


class NotesTask(Task):
    """Two agents and the Notebook environment of tests/test_tools.py, whose `write` tool the episode shares."""

    name = "notes"
    agents = [{"name": "writer", "system_prompt": "Write."}, {"name": "reader", "system_prompt": "Read."}]
    reward_funcs = [words_written]
    environment_factory = Notebook

    def dataset(self, split="train"):
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": "Take notes."}]] * 2})


def scripted_evaluation(monkeypatch, script):
    """`evaluate` with generation scripted by `script(tokenizer)` (a `_generate_single_turn`); the rollouts it played
    are kept in the list returned."""
    kept, evaluate = [], MAGRPOTrainer.evaluate

    def scripted(trainer, *args, **kwargs):
        trainer._generate_single_turn = script(trainer.processing_class)
        rollout = trainer._rollout
        trainer._rollout = lambda *a, **k: kept.append(rollout(*a, **k)) or kept[-1]
        return evaluate(trainer, *args, **kwargs)

    monkeypatch.setattr(MAGRPOTrainer, "evaluate", scripted)
    return kept


def test_evaluation_gives_each_agent_exactly_the_tools_it_trained_with(tiny_model_dir, tmp_path, monkeypatch):
    args = MAGRPOConfig(
        output_dir=str(tmp_path), agents=[{"name": "writer"}, {"name": "reader", "tools": []}],
        per_device_train_batch_size=2, num_generations=2, report_to="none", save_strategy="no", **SMALL,
    )  # fmt: skip
    MAGRPOTrainer(tiny_model_dir, args=args, task=NotesTask(), tools=[add]).save_model(str(tmp_path / "team"))
    kept = scripted_evaluation(monkeypatch, scripted_writer)
    evaluate_task(NotesTask(), team=tmp_path / "team", limit=2, **{**SMALL, "max_completion_length": 64})
    samples = [sample for rollout in kept for sample in rollout.samples]
    prompts = {agent: [sample.prompt_ids for sample in samples if sample.agent == agent] for agent in (0, 1)}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for agent, tools in ((0, ['"name": "add"', '"name": "write"']), (1, ['"name": "add"'])):
        for ids in prompts[agent]:
            rendered = tokenizer.decode(ids)
            assert [tool for tool in ('"name": "add"', '"name": "write"') if tool in rendered] == tools
    # every episode's notebook holds the writer's word only: the reader's call (the script writes one) never ran
    notes = [len(joint_action.environment.notes) for rollout in kept for joint_action in rollout.joint_actions]
    assert notes and set(notes) == {1}


class SevenProblems(MathToolCalls):
    """math_tool_calls on problems whose answer is 7."""

    def dataset(self, split="train"):
        return Dataset.from_dict({"prompt": [math_prompt("What is 3 + 4?")] * 2, "answer": ["7"] * 2})


def solves_seven(tokenizer):
    """The tool agent writes a program printing 7 as text (it makes no call), the reasoner answers 7."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    said = {TOOL_PROMPT[:40]: "```python\nprint(7)\n```", TOOL_CALLS_PROMPT[:40]: "```python\nprint(7)\n```"}

    def generate(prompt_ids, *args, **kwargs):
        rendered = [tokenizer.decode(ids) for ids in prompt_ids]
        texts = [next((text for key, text in said.items() if key in prompt), "Answer: 7") for prompt in rendered]
        return [tokenizer(text, add_special_tokens=False)["input_ids"] + [eos] for text in texts], None

    return generate


def test_a_team_trained_without_an_environment_is_evaluated_without_one(tiny_model_dir, tmp_path, monkeypatch):
    """recipes/atgrpo_math_tools.py --without_tools: no tools, no environment, the tool agent's program in its text;
    a correct program and answer score 1.0 there, as in training (with an unused `PythonRunner` it would score 0.5)."""
    from trl_marl.tasks import math_tool

    monkeypatch.setattr(math_tool, "run_tool", lambda text: (Fraction(7) if "print(7)" in text else None, "ran"))
    task = SevenProblems()
    task.environment_factory = None  # as the recipe's comparison arm
    agents = [
        {**agent, "tools": [], **({"system_prompt": TOOL_PROMPT} if agent["name"] == TOOL else {})}
        for agent in task.agents
    ]
    args = MAGRPOConfig.for_task(
        task, output_dir=str(tmp_path), agents=agents, per_device_train_batch_size=2, num_generations=2,
        report_to="none", save_strategy="no", **SMALL,
    )  # fmt: skip
    MAGRPOTrainer(tiny_model_dir, args=args, task=task).save_model(str(tmp_path / "team"))
    kept = scripted_evaluation(monkeypatch, solves_seven)
    metrics = evaluate_task(SevenProblems(), team=tmp_path / "team", limit=2, **SMALL)
    assert kept and all(ja.environment is None for rollout in kept for ja in rollout.joint_actions)
    assert metrics["reward"] == 1.0


def test_the_math_tool_calls_team_is_evaluated_with_run_python_for_its_tool_agent_alone(
    tiny_model_dir, tmp_path, monkeypatch
):
    task = SevenProblems()
    args = MAGRPOConfig.for_task(
        task, output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, report_to="none",
        save_strategy="no", **SMALL,
    )  # fmt: skip
    MAGRPOTrainer(tiny_model_dir, args=args, task=task).save_model(str(tmp_path / "team"))
    kept = scripted_evaluation(monkeypatch, solves_seven)
    evaluate_task(SevenProblems(), team=tmp_path / "team", limit=2, **SMALL)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    samples = [sample for rollout in kept for sample in rollout.samples]
    offered = {("run_python" in tokenizer.decode(sample.prompt_ids), sample.agent) for sample in samples}
    assert offered == {(True, 0), (False, 1)}  # the tool agent is offered run_python; the reasoner, nothing
    assert all(isinstance(ja.environment, PythonRunner) for rollout in kept for ja in rollout.joint_actions)
