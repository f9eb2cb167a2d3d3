"""The `code_tester` task's answers as the trainer judges them: the coder's program, the tester's asserts parsed into
trusted calls, and tests run on a program in the sandbox and judged outside it (see `code_tester.py`)."""

from __future__ import annotations

import ast
from dataclasses import dataclass

from ...sandbox import ExecutionResult, Status
from ..sandbox_runs import SandboxResultCache, extract_code, shared_sandbox
from .humaneval import TEST_LIMITS, AssertTest, assert_passed, decode_tests, encode_tests, parse_check

MAX_GENERATED_TESTS = 16  # the tester's first 16 asserts count; more are ignored (bounds every run)
# What `ast.parse`/`ast.unparse` raise on model-written text: a syntax error, a null byte (ValueError), nesting deeper
# than the parser or the recursion limit allows.
UNPARSEABLE = (SyntaxError, ValueError, RecursionError, MemoryError)


# ---------------------------------------------------------------------------------------------------------- answers


def solution_code(text: str) -> str:
    """The coder's code: its answer's fenced blocks (else the whole text) without top-level `assert` lines, so that
    tests the coder wrote for itself do not run as part of the solution."""
    code = extract_code(text)
    try:
        module = ast.parse(code)
    except UNPARSEABLE:
        return code.strip()
    lines = code.splitlines()
    for node in reversed(module.body):
        if isinstance(node, ast.Assert):
            del lines[node.lineno - 1 : node.end_lineno]
    return "\n".join(lines).strip()


def coder_program(text: str, problem: str) -> str:
    """The program the coder's answer stands for: the problem's prompt (its imports, helper functions and the stub of
    the function), then `solution_code(text)`, whose definition replaces the stub."""
    return f"{problem.rstrip()}\n\n\n{solution_code(text)}\n"


@dataclass(frozen=True)
class GeneratedTest:
    """One of the tester's asserts: its source, and the call and expected value it checks (None: not checkable)."""

    source: str
    test: AssertTest | None


class _AsCandidate(ast.NodeTransformer):
    """Calls of the entry point become calls of `candidate`, and `is True/False/None` becomes `==`, so that an
    assert reads as HumanEval's `check(candidate)` asserts do."""

    def __init__(self, entry_point: str):
        self.entry_point = entry_point

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name("candidate", node.ctx) if node.id == self.entry_point else node

    def visit_Compare(self, node: ast.Compare) -> ast.Compare:
        self.generic_visit(node)
        if len(node.ops) == 1 and isinstance(node.ops[0], ast.Is) and isinstance(node.comparators[0], ast.Constant):
            node.ops = [ast.Eq()]
        return node


def _checked(node: ast.Assert, entry_point: str) -> AssertTest | None:
    try:
        renamed = _AsCandidate(entry_point).visit(ast.parse(ast.unparse(node.test), mode="eval").body)
        parsed = parse_check(f"def check(candidate):\n    assert {ast.unparse(renamed)}\n")
        if parsed:
            encode_tests(parsed)  # plain values only (a complex number, say, could not reach the sandbox)
    except (*UNPARSEABLE, TypeError):
        return None
    return parsed[0] if parsed else None


def generated_tests(text: str, entry_point: str) -> tuple[GeneratedTest, ...]:
    """The tester's tests: the `assert` statements of its answer's code (its fenced blocks, else the whole text), in
    order, at most `MAX_GENERATED_TESTS`. Code that does not parse as a whole is read line by line, so that one broken
    line (say, a truncated last test) costs only itself."""
    code = extract_code(text)
    try:
        asserts = sorted(
            (n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assert)), key=lambda n: (n.lineno, n.col_offset)
        )
    except UNPARSEABLE:
        asserts = []
        for line in code.splitlines():
            if line.strip().startswith("assert"):
                try:
                    asserts += [n for n in ast.parse(line.strip()).body if isinstance(n, ast.Assert)]
                except UNPARSEABLE:
                    continue
    tests = []
    for node in asserts[:MAX_GENERATED_TESTS]:
        try:
            source = ast.unparse(node)
        except UNPARSEABLE:
            source = "assert ... (too deeply nested to show)"
        tests.append(GeneratedTest(source, _checked(node, entry_point)))
    return tuple(tests)


# ---------------------------------------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class Outcome:
    """One test on one program: passed, and what the program did (for the feedback)."""

    passed: bool
    note: str


RUN_FAILED = "the run failed: "  # the note of every test of a run that did not end ok
# Judged (program, tests) pairs: rewards, the transition and `success` ask the same questions.
_JUDGED = SandboxResultCache(size=4096)


def shorten(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def judge(program: str, entry_point: str, tests: tuple[AssertTest | None, ...]) -> tuple[Outcome, ...]:
    """Run `tests` against `program` in the sandbox (one run) and judge each outside it (`assert_passed`). A test
    that is not checkable (None) fails; when the run does not end ok, every test fails."""
    checkable = [test for test in tests if test is not None]
    judged = iter(_judge_checkable(program, entry_point, tuple(checkable)) if checkable else ())
    unchecked = Outcome(False, "not a checkable test: write `assert f(literal arguments) == literal value`")
    return tuple(unchecked if test is None else next(judged) for test in tests)


def _judge_checkable(program: str, entry_point: str, tests: tuple[AssertTest, ...]) -> tuple[Outcome, ...]:
    def run() -> tuple[tuple[Outcome, ...], ExecutionResult]:
        result = shared_sandbox().call(program, entry_point, [test.args for test in tests], TEST_LIMITS)
        if not result.ok:
            # The program's own words: feedback only.
            error = [line for line in result.stderr.splitlines() if line.strip()]
            why = shorten(error[-1], 120) if error and result.status is Status.ERROR else result.reason
            return (Outcome(False, f"{RUN_FAILED}{result.status.value} ({why})"),) * len(tests), result
        outcomes = tuple(
            Outcome(assert_passed(test, output), shorten(f"raised {output.error}" if output.error is not None
                                                         else f"returned {output.value!r}"))
            for test, output in zip(tests, result.outputs)
        )  # fmt: skip
        return outcomes, result

    return _JUDGED.get_or_run((program, entry_point, encode_tests(list(tests))), run)


@dataclass(frozen=True)
class PairResult:
    """The tester's tests on the coder's code."""

    tests: tuple[GeneratedTest, ...]
    outcomes: tuple[Outcome, ...]

    @property
    def agreement(self) -> float:
        """Share of the tester's tests that pass on the coder's code (0.0 without tests)."""
        return sum(o.passed for o in self.outcomes) / len(self.outcomes) if self.outcomes else 0.0

    @property
    def agreed(self) -> bool:
        """The episode's end: there are tests, and every one passes on the code."""
        return bool(self.outcomes) and all(o.passed for o in self.outcomes)


def tests_on_code(coder_text: str, tester_text: str, entry_point: str, problem: str) -> PairResult:
    tests = generated_tests(tester_text, entry_point)
    outcomes = judge(coder_program(coder_text, problem), entry_point, tuple(t.test for t in tests)) if tests else ()
    return PairResult(tests, outcomes)


def own_pass_rate(coder_text: str, entry_point: str, tests: str, problem: str) -> float:
    """Share of the problem's own tests (a `tests` cell) that the coder's code passes."""
    own = tuple(decode_tests(tests))
    return sum(o.passed for o in judge(coder_program(coder_text, problem), entry_point, own)) / len(own)
