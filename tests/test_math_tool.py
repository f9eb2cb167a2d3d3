"""The AT-GRPO paper's math task (`math_tool`): exact answer parsing and comparison, the seeded problem generator
(answers recomputed independently from the text), the tool agent's program run in the sandbox, the rewards and the
transition on hand-written answers, a few AT-GRPO steps on a tiny model, and the CPU recipe end to end."""

import json
import os
import random
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from sandbox_helpers import require_bubblewrap
from test_trainer import lora_params, randomize_adapters
from tiny_run import TINY_RUN

import trl_marl.tasks.math_tool as math_tool
from trl_marl import ATGRPOConfig, ATGRPOTrainer, NextTurn
from trl_marl.registry import load_plugin
from trl_marl.tasks.math_tool import (
    REASONER,
    TOOL,
    MathTool,
    arithmetic_dataset,
    arithmetic_problem,
    final_answer,
    math_both_correct,
    parse_number,
    reasoner_correct,
    run_tool,
    tool_correct,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: 42", Fraction(42)),
        ("Answer: -17", Fraction(-17)),
        ("Answer: 1,234,567", Fraction(1234567)),
        ("Answer: $1,234.50.", Fraction(246900, 200)),
        ("Answer: 7/2", Fraction(7, 2)),
        ("Answer: -7/2 liters", Fraction(-7, 2)),
        ("Answer: 3.5", Fraction(7, 2)),
        ("so the total is \\boxed{\\frac{3}{4}}.", Fraction(3, 4)),
        ("\\boxed{-\\dfrac{3}{4}}", Fraction(-3, 4)),
        ("\\boxed{12}", Fraction(12)),
        ("#### 72", Fraction(72)),
        ("First \\boxed{12}, then I checked.\nAnswer: 13", Fraction(13)),  # the last marker wins
        ("Answer: 13\nOn reflection \\boxed{14}", Fraction(14)),
        ("Answer: 3, 4", Fraction(3)),  # a comma that is no thousands separator ends the number
        ("answer : 9", Fraction(9)),
    ],
)
def test_final_answers_are_parsed_exactly(text, expected):
    assert final_answer(text) == expected


@pytest.mark.parametrize(
    "text", ["The answer is 42.", "Answer: none", "Answer: 7/0", "\\boxed{}", "", "Answer: " + "9" * 5000]
)
def test_no_marked_number_is_no_answer(text):  # the last: more digits than Python converts
    assert final_answer(text) is None


def test_answers_compare_exactly_without_float_fuzz():
    assert parse_number("0.3333333333333333") != Fraction(1, 3)
    assert parse_number("3.50") == parse_number("7/2") == parse_number("\\frac{14}{4}") == Fraction(7, 2)
    completions = ["Answer: 7/2", "Answer: 3.5", "Answer: 0.3333", "Answer: 1/3", "no answer"]
    answers = ["7/2", "7/2", "1/3", "1/3", "1/3"]
    assert reasoner_correct(None, completions, answers) == [1.0, 1.0, 0.0, 1.0, 0.0]


# ---------------------------------------------------------------------------------------------------------- data

# The generator's sentences, read back independently of it: (pattern, operation on the amount).
READ_BACK = [
    (r"has (\d+) \w+ of", lambda amount, n: Fraction(n)),
    (r"buys (\d+) more|gives \w+ another (\d+)|adds (\d+)", lambda amount, n: amount + n),
    (r"uses (\d+)|gives (\d+) \w+ to a friend|spills (\d+)", lambda amount, n: amount - n),
    (r"becomes (\d+) times as large", lambda amount, n: amount * n),
    (r"(doubles)", lambda amount, n: amount * 2),
    (r"(triples)", lambda amount, n: amount * 3),
    (r"into (\d+) jars", lambda amount, n: amount / n),
    (r"with (\d+) friends?, keeping one equal share", lambda amount, n: amount / (n + 1)),
]


def recompute(question: str) -> tuple[Fraction, int]:
    """The answer of a generated question from its own text, and how many operations it states."""
    amount, operations = None, 0
    for sentence in question.split(". ")[:-1]:
        for pattern, apply in READ_BACK:
            match = re.search(pattern, sentence)
            if match:
                word = next(group for group in match.groups() if group)
                amount = apply(amount, int(word) if word.isdigit() else 0)
                operations += 1
                break
        else:
            raise AssertionError(f"unreadable sentence {sentence!r}")
    return amount, operations - 1


def test_generated_answers_are_right_and_respect_the_difficulty():
    rng = random.Random(7)
    for steps, max_number in [(1, 5), (3, 20), (5, 50)]:
        for _ in range(50):
            question, answer = arithmetic_problem(rng, steps, max_number)
            recomputed, operations = recompute(question)
            assert (recomputed, operations) == (answer, steps), question
            assert answer >= 0 and max(int(n) for n in re.findall(r"\d+", question)) <= max(max_number, 5)


def test_the_offline_data_is_deterministic_per_seed_and_eval_shares_no_question_with_train():
    train, again, held_out = arithmetic_dataset("train"), arithmetic_dataset("train"), arithmetic_dataset("eval")
    assert train.to_dict() == again.to_dict()
    assert not set(train["question"]) & set(held_out["question"])
    assert (len(train), len(held_out)) == (math_tool.TRAIN_SIZE, math_tool.EVAL_SIZE)
    for row in held_out:
        assert Fraction(row["answer"]) == recompute(row["question"])[0]
        assert row["prompt"] == [{"role": "user", "content": f"Problem: {row['question']}"}]
    assert any("/" in answer for answer in train["answer"])  # divisions make some answers fractions
    harder = arithmetic_dataset("eval", steps=5, max_number=100)
    assert all(recompute(q)[1] == 5 for q in harder["question"])


def test_bad_settings_name_the_bad_value():
    with pytest.raises(ValueError, match="steps=0"):
        MathTool(steps=0)
    with pytest.raises(ValueError, match="'mathqa'"):
        MathTool(source="mathqa")
    with pytest.raises(ValueError, match="'validation'"):
        arithmetic_dataset("validation")


def test_the_hub_source_is_gsm8k_with_the_number_after_the_hashes(monkeypatch):
    from datasets import Dataset

    loaded = []

    def load_dataset(path, name, split):  # stands in for the download
        loaded.append((path, name, split))
        return Dataset.from_dict(
            {"question": ["How many?", "And now?"], "answer": ["3 + 4 = <<3+4=7>>7\n#### 7", "So\n#### 1,250"]}
        )

    monkeypatch.setattr("datasets.load_dataset", load_dataset)
    rows = MathTool(source="hub").dataset("eval")
    assert loaded == [("openai/gsm8k", "main", "test")]
    assert rows["answer"] == ["7", "1250"] and rows["question"] == ["How many?", "And now?"]


def test_the_task_and_rewards_are_plugins():
    task = load_plugin("tasks", "math_tool")
    assert (task.name, task.num_turns, task.scheduler) == ("math_tool", 4, "debate")
    assert [agent["name"] for agent in task.agents] == [TOOL, REASONER]
    assert load_plugin("rewards", "math_both_correct") is math_both_correct
    assert load_plugin("rewards", "tool_correct") is tool_correct
    assert load_plugin("rewards", "reasoner_correct") is reasoner_correct


# ---------------------------------------------------------------------------------------------------------- tool

FRACTION_PROGRAM = "```python\nfrom fractions import Fraction\n\nprint(Fraction(21, 6))\n```"


@pytest.fixture
def sandbox(monkeypatch):
    require_bubblewrap()
    from trl_marl.sandbox import Sandbox

    sandbox = Sandbox("bubblewrap")
    monkeypatch.setattr(math_tool, "shared_sandbox", lambda: sandbox)
    math_tool._RUNS.clear()
    yield sandbox
    math_tool._RUNS.clear()


def test_the_tool_program_runs_in_the_sandbox_and_its_printed_answer_counts(sandbox):
    # bubblewrap gives the sandbox its own hostname: the answer can only be 7 if the program ran in there.
    in_sandbox = "```python\nimport socket\nprint(7 if socket.gethostname() == 'sandbox' else 8)\n```"
    assert run_tool(in_sandbox)[0] == 7
    assert run_tool(FRACTION_PROGRAM) == (Fraction(7, 2), "the program printed '7/2'")
    assert run_tool("```python\nprint('Answer: 12')\n```")[0] == 12
    assert run_tool("```python\nprint(1 / 3)\n```")[0] != Fraction(1, 3)  # a float is taken as printed: not exact
    answer, what = run_tool("```python\nraise ValueError('no idea')\n```")
    assert answer is None and what == "the program failed: ValueError: no idea"
    assert run_tool("```python\nx = 3\n```") == (None, "the program printed nothing")
    assert run_tool("The answer is 7/2.")[0] is None  # prose is no program: a syntax error
    completions = [FRACTION_PROGRAM, "```python\nprint(3)\n```", "I would compute it."]
    assert tool_correct(None, completions, ["7/2"] * 3) == [1.0, 0.0, 0.0]


def test_team_reward_is_both_correct_and_logs_the_accuracies(sandbox):
    logged = {}
    completions = [
        {TOOL: FRACTION_PROGRAM, REASONER: "7 divided by 2.\nAnswer: 7/2"},
        {TOOL: FRACTION_PROGRAM, REASONER: "Answer: 4"},
        {TOOL: "```python\nprint(4)\n```", REASONER: "Answer: 4"},  # they agree, on a wrong answer
        {TOOL: "", REASONER: ""},
    ]
    rewards = math_both_correct(None, completions, ["7/2"] * 4, log_metric=logged.__setitem__)
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert logged == {
        "math/accuracy": 1 / 4,
        "math/tool_accuracy": 2 / 4,
        "math/reasoner_accuracy": 1 / 4,
        "math/agreement": 2 / 4,
    }


def test_the_episode_ends_when_the_agents_agree_and_otherwise_each_sees_the_others_answer(sandbox):
    task = MathTool()
    row = {"prompt": [{"role": "user", "content": "Problem: Ava has 7 liters..."}], "answer": "7/2"}
    state = task.reset(row)
    state = task.step(state, TOOL, "```python\nprint(4)\n```", 0)
    state = task.step(state, REASONER, "Half of 7.\nAnswer: 3", 0)
    prompts = task.transition(prompt=row["prompt"], state=state, turn=0, answer="7/2")
    tool_view, reasoner_view = prompts[TOOL][-1]["content"], prompts[REASONER][-1]["content"]
    assert tool_view.startswith("Problem: Ava has 7 liters...")
    assert "Your answer: 4 (the program printed '4')." in tool_view and "the reasoner: 3." in tool_view
    assert "Your answer: 3." in reasoner_view and "(Python): 4 (the program printed '4')" in reasoner_view
    assert "7/2" not in tool_view + reasoner_view  # the expected answer is never shown
    assert not task.success(row, state, {})
    state = task.step(state, TOOL, FRACTION_PROGRAM, 1)
    state = task.step(state, REASONER, "I see, 7/2.\nAnswer: 3.5", 1)
    assert task.transition(prompt=row["prompt"], state=state, turn=1, answer="7/2") == NextTurn(done=True)
    assert task.success(row, state, {})
    wrong = task.step(task.step(task.reset(row), TOOL, "```python\nprint(4)\n```", 0), REASONER, "Answer: 4", 0)
    assert task.transition(prompt=row["prompt"], state=wrong, turn=0, answer="7/2").done  # agreeing ends it, even
    assert not task.success(row, wrong, {})  # on a wrong answer
    alone = task.step(task.reset(row), "solo", "Answer: 7/2\n" + FRACTION_PROGRAM, 0)  # the single baseline's agent
    assert alone == {TOOL: "Answer: 7/2\n" + FRACTION_PROGRAM, REASONER: "Answer: 7/2\n" + FRACTION_PROGRAM}


# ---------------------------------------------------------------------------------------------------------- training


class MathWithLengthBonus(MathTool):
    """A tiny random model never answers right: a small length bonus makes its candidates differ, so that both
    adapters get a gradient while the task's rewards, state and transition run underneath."""

    local_reward_funcs = {
        agent: [*funcs, lambda prompts, completions, **kwargs: [len(c) / 100 for c in completions]]
        for agent, funcs in MathTool.local_reward_funcs.items()
    }


def test_a_few_at_grpo_steps_train_both_agents_on_a_tiny_model(tiny_model_dir, tmp_path):
    task = MathWithLengthBonus()
    args = ATGRPOConfig.for_task(
        task, num_turns=2, output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, max_steps=2, **TINY_RUN, seed=3,
    )  # fmt: skip
    trainer = ATGRPOTrainer(tiny_model_dir, args=args, task=task, train_dataset=task.dataset("eval"))
    randomize_adapters(trainer)
    before = {name: lora_params(trainer.model, name) for name in (TOOL, REASONER)}
    trainer.train()
    for name, params in before.items():
        after = lora_params(trainer.model, name)
        assert any(not torch.equal(params[n], after[n]) for n in params), f"adapter {name} did not change"
    for logged in trainer.state.log_history[:2]:
        # Random text never answers, so the agents never agree: every episode runs to the turn limit, unsolved.
        assert logged["episodes/num_turns"] == 2.0 and logged["episodes/success_rate"] == 0.0
        assert logged["math/accuracy"] == 0.0 and logged["math/agreement"] == 0.0
        assert logged["turns/1/agents/reasoner/group_reward_std"] > 0.0  # the length bonus: a signal per group


def test_the_paper_scale_recipe_is_predicted_to_fit_one_24_gb_card(capsys):
    from trl_marl.cli import main

    qwen = REPO / "recipes" / "paper" / "model_configs" / "Qwen3-1.7B"  # its config.json: the planner needs no weights
    path = REPO / "recipes" / "paper" / "atgrpo_math.yaml"
    main(["estimate", str(path), "--model_name_or_path", str(qwen), "--prompt_length", "512", "--gpu_memory_gb", "24"])
    assert "24 GB card: fits" in capsys.readouterr().out


def test_the_single_agent_baseline_evaluates_one_answer_in_both_roles(tiny_model_dir):
    from trl_marl.cli.evaluation import evaluate_task

    settings = dict(model=tiny_model_dir, limit=1, max_completion_length=8, use_cpu=True)
    metrics = evaluate_task("math_tool", "single", **settings)
    assert metrics["math/accuracy"] == 0.0 and metrics["reward"] == 0.0  # random text: no code, no answer


# ---------------------------------------------------------------------------------------------------------- recipe


def test_the_paper_scale_recipe_is_a_valid_config_with_the_papers_settings_each_with_its_source():
    from trl_marl.cli.train import parse_train_config

    path = REPO / "recipes" / "paper" / "atgrpo_math.yaml"
    script_args, args = parse_train_config(str(path), ["--bf16", "false"])  # bf16 needs a GPU
    assert (script_args.algorithm, script_args.task, script_args.model_name_or_path, script_args.load_in_4bit) == (
        "at_grpo",
        "math_tool",
        "Qwen/Qwen3-1.7B",
        True,
    )
    assert args.agent_names == [TOOL, REASONER] and args.scheduler == "debate"
    assert (args.num_generations, args.num_turns, args.team_reward_weight, args.continuation) == (4, 4, 1.0, "greedy")
    assert (args.learning_rate, args.temperature, args.top_p, args.beta) == (1e-6, 1.0, 1.0, 0.0)
    assert args.chat_template_kwargs == {"enable_thinking": False} and args.generation_batch_size == 8
    assert args.model_init_kwargs == {"dtype": "bfloat16"}
    settings = [line for line in path.read_text().splitlines() if line and not line.startswith(("#", " "))]
    assert all("#" in line for line in settings if not line.endswith(":")), "a setting without its source"


@pytest.mark.slow  # ~150 s; the default run trains math_tool with AT-GRPO and the sandbox on a tiny model
def test_the_cpu_recipe_trains_and_reports_the_accuracy(tmp_path, default_model_dir):
    require_bubblewrap()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "recipes" / "atgrpo_math.py"), "--output_dir", str(tmp_path),
               "--max_steps", "2", "--logging_steps", "1", "--eval_problems", "2", "--max_completion_length", "24",
               "--num_generations", "2", "--per_device_train_batch_size", "4"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["task"], results["source"], results["steps"]) == ("math_tool", "offline", 2)
    for figures in (results["before"], results["after"]):
        assert 0.0 <= figures["accuracy"] <= 1.0 and 1.0 <= figures["turns"] <= 2.0
        assert 0.0 <= figures["tool_accuracy"] <= 1.0 and 0.0 <= figures["reasoner_accuracy"] <= 1.0
        assert figures["final_team_reward"] is not None
    assert (tmp_path / "tool" / "adapter_config.json").is_file() and (tmp_path / "reasoner").is_dir()
    assert "Before training:" in result.stdout and "After 2 steps:" in result.stdout
