"""Trusted scoring, in the parent: from a run's plain outputs and expected values that never entered the sandbox."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .harness import HashCheck, PlainBoundError
from .result import ExecutionResult

# Set elements or dict keys with one hash, in a value decoded from a run (see HashCheck) or in a comparison.
MAX_SHARED_HASH = 16


def strict_equal(expected: Any, actual: Any, rel_tol: float = 1e-9, abs_tol: float = 0.0) -> bool:
    """Exact, type-checked equality: types must match exactly (``True`` is not ``1``, ``(1,)`` is not ``[1]``); floats
    compare with ``math.isclose(rel_tol, abs_tol)`` and NaN equals NaN; lists, tuples and dict values compare item by
    item; set elements and dict keys compare exactly, types included, and NaN equals NaN there too.

    Never raises, and stays linear in the size of the values: set elements and dict keys are hashed in a typed form,
    which crafted values can make collide where the decoded values did not, so a set or dict that `HashCheck` refuses
    in that form equals nothing."""
    try:
        return _equal(expected, actual, rel_tol, abs_tol, HashCheck(MAX_SHARED_HASH))
    except PlainBoundError:
        return False


def _equal(expected: Any, actual: Any, rel_tol: float, abs_tol: float, hashes: HashCheck) -> bool:
    if type(expected) is not type(actual):
        return False
    if type(expected) is float:
        return (math.isnan(expected) and math.isnan(actual)) or math.isclose(
            expected, actual, rel_tol=rel_tol, abs_tol=abs_tol
        )
    if type(expected) in (list, tuple):
        return len(expected) == len(actual) and all(
            _equal(e, a, rel_tol, abs_tol, hashes) for e, a in zip(expected, actual)
        )
    # Set elements and dict keys are matched by typed key, not looked up: a NaN key is not found by another NaN.
    if type(expected) in (set, frozenset):
        return len(expected) == len(actual) and set(_typed_keys(expected, hashes)) == set(_typed_keys(actual, hashes))
    if type(expected) is dict:
        if len(expected) != len(actual):
            return False
        expected_groups, actual_groups = _by_typed_key(expected, hashes), _by_typed_key(actual, hashes)
        return expected_groups.keys() == actual_groups.keys() and all(
            len(values) == len(actual_groups[key])
            and all(_equal(e, a, rel_tol, abs_tol, hashes) for e, a in zip(values, actual_groups[key]))
            for key, values in expected_groups.items()
        )
    return expected == actual  # None, bool, int, str, bytes: exact


def _typed_key(value: Any, hashes: HashCheck) -> Any:
    """A hashable stand-in for a set element or dict key that equals another only if the types match too, so that
    ``{1}`` is not ``{True}`` and ``{(1,)}`` is not ``{(1.0,)}``, and NaN equals NaN. Elements compare exactly (no
    float tolerance)."""
    if type(value) is tuple:
        return tuple, tuple([_typed_key(item, hashes) for item in value])
    if type(value) is frozenset:
        return frozenset, len(value), frozenset(_typed_keys(value, hashes))
    if type(value) is float and math.isnan(value):
        return float, "nan"
    return type(value), value


def _typed_keys(keys: Any, hashes: HashCheck) -> list:
    """The typed keys of a set's elements or a dict's keys, checked by ``hashes`` (PlainBoundError) before anything
    hashes them. Keys that differ only in which NaN they hold have one typed key."""
    typed, nested = [], set()
    for key in keys:
        kind = type(key)
        if kind is tuple or kind is frozenset:
            colliding = hashes.colliding
            typed.append(_typed_key(key, hashes))
            if hashes.colliding > colliding:
                nested.add(len(typed) - 1)
        else:
            typed.append(_typed_key(key, hashes) if kind is float else (kind, key))
    hashes.check(typed, nested)
    return typed


def _by_typed_key(mapping: dict, hashes: HashCheck) -> dict:
    """Typed key → the values of a dict's keys with that typed key, in order (several only for NaN keys)."""
    groups = {}
    for key, value in zip(_typed_keys(mapping, hashes), mapping.values()):
        groups.setdefault(key, []).append(value)
    return groups


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
