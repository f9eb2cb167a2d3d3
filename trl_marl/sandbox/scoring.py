"""Trusted scoring, in the parent: from a run's plain outputs and expected values that never entered the sandbox."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .result import ExecutionResult


def strict_equal(expected: Any, actual: Any, rel_tol: float = 1e-9, abs_tol: float = 0.0) -> bool:
    """Exact, type-checked equality: types must match exactly (``True`` is not ``1``, ``(1,)`` is not ``[1]``); floats
    compare with ``math.isclose(rel_tol, abs_tol)`` and NaN equals NaN; lists, tuples and dict values compare item by
    item; set elements and dict keys compare exactly, types included."""
    if type(expected) is not type(actual):
        return False
    if type(expected) is float:
        return (math.isnan(expected) and math.isnan(actual)) or math.isclose(
            expected, actual, rel_tol=rel_tol, abs_tol=abs_tol
        )
    if type(expected) in (list, tuple):
        return len(expected) == len(actual) and all(
            strict_equal(e, a, rel_tol, abs_tol) for e, a in zip(expected, actual)
        )
    if type(expected) is dict:
        return _typed_keys(expected) == _typed_keys(actual) and all(
            strict_equal(value, actual[key], rel_tol, abs_tol) for key, value in expected.items()
        )
    if type(expected) in (set, frozenset):
        return _typed_keys(expected) == _typed_keys(actual)
    return expected == actual  # None, bool, int, str, bytes: exact


def _typed_key(value: Any) -> Any:
    """A hashable stand-in for a set element or dict key that equals another only if the types match too, so that
    ``{1}`` is not ``{True}`` and ``{(1,)}`` is not ``{(1.0,)}``. Elements compare exactly (no float tolerance)."""
    if type(value) is tuple:
        return tuple, tuple(_typed_key(item) for item in value)
    if type(value) is frozenset:
        return frozenset, _typed_keys(value)
    if type(value) is float and math.isnan(value):
        return float, "nan"
    return type(value), value


def _typed_keys(values: Any) -> frozenset:
    return frozenset(_typed_key(value) for value in values)


def passed_calls(result: ExecutionResult, expected: Sequence[Any], rel_tol: float = 1e-9, abs_tol: float = 0.0):
    """Per expected value, whether the run's call returned exactly it. All False unless the run ended ok with one
    output per expected value (a timeout, a signal, an early exit, missing or extra results all fail every test)."""
    if not result.ok or result.outputs is None or len(result.outputs) != len(expected):
        return [False] * len(expected)
    return [
        output.error is None and strict_equal(value, output.value, rel_tol, abs_tol)
        for value, output in zip(expected, result.outputs)
    ]


def pass_rate(result: ExecutionResult, expected: Sequence[Any], rel_tol: float = 1e-9, abs_tol: float = 0.0) -> float:
    """Fraction of calls that returned exactly the expected value (0.0 for a run that did not end ok)."""
    if not expected:
        raise ValueError("pass_rate needs at least one expected value.")
    passed = passed_calls(result, expected, rel_tol, abs_tol)
    return sum(passed) / len(passed)


def stdout_matches(result: ExecutionResult, expected_stdout: str) -> bool:
    """Whether a program ended ok and printed exactly ``expected_stdout``: every line, in order, none extra (trailing
    spaces and trailing blank lines are ignored)."""
    if not result.ok or result.stdout_truncated:
        return False

    def lines(text: str) -> list[str]:
        stripped = [line.rstrip() for line in text.splitlines()]
        while stripped and not stripped[-1]:
            stripped.pop()
        return stripped

    return lines(result.stdout) == lines(expected_stdout)
