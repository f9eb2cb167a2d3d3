"""The built-in `unit_tests` team reward: run the team's code in the sandbox and score it against hidden tests."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ...sandbox import CallTest
from ..completions import completion_text
from ..sandbox_runs import extract_code, shared_sandbox


def team_code(completion: Any) -> str:
    """The code of one joint action: every agent's code, in agent order (so one agent's helper precedes the next
    agent's function that calls it); also accepts a single agent's text or chat messages."""
    if isinstance(completion, dict):
        return "\n\n".join(team_code(text) for text in completion.values())
    return extract_code(completion_text(completion))


def parse_tests(tests: str | Sequence[dict]) -> list[CallTest]:
    """A ``tests`` cell → CallTests. The cell is a list of ``{"args": [...], "expected": value}``, or that list as a
    JSON string (an Arrow column cannot hold values of mixed types; a string column can). JSON has no tuples, so a
    function that returns a tuple never matches an expected value parsed from JSON."""
    if isinstance(tests, str):
        tests = json.loads(tests)
    parsed = []
    for index, test in enumerate(tests):
        if not isinstance(test, dict) or set(test) != {"args", "expected"} or not isinstance(test["args"], list):
            raise ValueError(
                f"tests[{index}] must be {{'args': [...], 'expected': value}}, got {test!r}. Each test calls the "
                "entry point with `args` and expects exactly `expected`."
            )
        parsed.append(CallTest(tuple(test["args"]), test["expected"]))
    if not parsed:
        raise ValueError("a `tests` cell is empty: give each problem at least one test.")
    return parsed


def unit_tests(prompts, completions, entry_point, tests, **kwargs) -> list[float]:
    """Fraction of a problem's tests the team's joined code passes, run in the sandbox (0.0 for a timeout, a crash, an
    early exit or any output the harness did not produce). Dataset columns: ``entry_point`` (the function's name) and
    ``tests`` (see `parse_tests`). All joint actions of a batch run concurrently."""
    requests = [
        (team_code(completion), name, parse_tests(cell))
        for completion, name, cell in zip(completions, entry_point, tests)
    ]
    return shared_sandbox().check_many(requests)
