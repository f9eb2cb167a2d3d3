"""A run's call results in the trainer: parsed under hard bounds before anything is hashed or compared, parsing counted
in the run's wall time, and compared without going quadratic or tripping over NaN keys.

Every value here could come from the candidate: it can print any results document it likes (up to
``Limits.output_bytes``) on the results stream, file descriptor 3.
"""

import gc
import itertools
import json
import time

import pytest
from sandbox_helpers import require_bubblewrap

from trl_marl.sandbox import CallTest, Limits, Sandbox, Status, harness, strict_equal
from trl_marl.sandbox import executor as executor_module
from trl_marl.sandbox.harness import decode_plain

M = 2**61 - 1  # CPython hashes an int as its value mod M: every multiple of M hashes to 0


@pytest.fixture(scope="module")
def sandbox():
    require_bubblewrap()
    return Sandbox("bubblewrap", limits=Limits(wall_time_s=10.0, memory_bytes=256 * 2**20))


def nan() -> float:
    return float("nan")  # a new object each time, as decoding makes: equal by identity would hide the bug


def printing(document: str) -> str:
    """A candidate that writes ``document`` as its results and exits before the harness writes its own."""
    return f"import os\ndata = {document!r}.encode()\nwhile data:\n    data = data[os.write(3, data):]\nos._exit(0)\n"


def results(*values) -> bytes:
    return json.dumps({"results": [{"value": value} for value in values]}).encode()


def nested_collisions(depth: int, shared: int = 4) -> list:
    """``shared + 1`` frozensets at ``depth`` that share a hash, each holding ``shared`` that share a hash, and so on
    down to multiples of M: comparing two of them compares ``shared`` candidates per element at every level."""
    family = [index * M for index in range(shared + 1)]
    for _ in range(depth):
        family = [{"frozenset": list(combination)} for combination in itertools.combinations(family, shared)]
    return family


# Bounds (issue 21, item 5)


def test_bounded_decoder_refuses_deep_large_and_colliding_values():
    def bounded():
        return harness.PlainDecoder(max_depth=64, max_values=100_000, max_shared_hash=16)

    deep = 0
    for _ in range(64):
        deep = [deep]
    assert bounded().decode(deep) == deep  # 64 nested lists: at the bound
    with pytest.raises(ValueError, match="deeper than 64"):
        bounded().decode([deep])
    with pytest.raises(ValueError, match="deeper than 64"):
        bounded().decode({"tuple": [deep]})

    decoder = bounded()
    decoder.decode([0] * 60_000)
    with pytest.raises(ValueError, match="more than 100000 values"):
        decoder.decode([0] * 40_000)  # the count runs over all the values one decoder decodes

    # Honest values do collide now and then: -1 and -2 share a hash, and so do 0 and M.
    assert bounded().decode({"set": [0, M, -1, -2]}) == {0, M, -1, -2}
    power_set = [{"frozenset": [-1, 3]}, {"frozenset": [-2, 3]}, {"frozenset": [-1, -2]}]
    assert len(bounded().decode({"set": power_set})) == 3
    colliding = [index * M for index in range(40)]
    for crafted in (
        {"set": colliding},
        {"frozenset": colliding},
        {"dict": [[key, 0] for key in colliding]},
        {"set": [{"tuple": [key, "x"]} for key in colliding]},  # a tuple's hash combines its items'
    ):
        with pytest.raises(ValueError, match="more than 16 set elements or dict keys share a hash"):
            bounded().decode(crafted)
    with pytest.raises(ValueError, match="hold"):
        bounded().decode({"set": nested_collisions(3)})

    # The trusted direction (the harness decoding a call's arguments) keeps no bounds.
    assert decode_plain({"set": colliding}) == set(colliding)
    assert decode_plain([deep] * 2) == [deep] * 2


def test_results_over_a_bound_are_malformed_before_anything_is_hashed():
    deep = 0
    for _ in range(65):
        deep = [deep]
    for stdout, bound in [
        (results(deep), "deeper than 64 levels"),
        (b'{"results": [{"value": ' + b"[" * 90_000 + b"]" * 90_000 + b"}]}", "deeper than 64 levels"),
        (results([0] * 60_000, [0] * 40_001), "more than 100000 values"),
        (results({"set": [index * M for index in range(1000)]}), "more than 16 set elements or dict keys share"),
        (results({"set": nested_collisions(4)}), "hold"),
    ]:
        with pytest.raises(ValueError, match=bound):
            executor_module._parse_outputs(stdout, expected_count=stdout.count(b'"value"'))
    honest = executor_module._parse_outputs(results({"set": [0, M]}, "x"), expected_count=2)
    assert [output.value for output in honest] == [{0, M}, "x"]


def test_a_document_of_too_many_containers_is_refused_before_it_is_parsed(monkeypatch):
    # json.loads would build all 350k lists first, each counting towards a garbage collection of the trainer's whole
    # heap (0.6 s with torch imported): the containers are counted in the bytes before anything is built.
    def never(document):
        raise AssertionError("json.loads ran on a document over the bound")

    flood = b'{"results": [{"value": [' + b"[]," * 350_000 + b"[]]}]}"
    monkeypatch.setattr(executor_module.json, "loads", never)
    with pytest.raises(ValueError, match="more than 100000 values"):
        executor_module._parse_outputs(flood, expected_count=1)


def test_results_are_parsed_with_the_garbage_collector_paused_and_it_is_resumed(sandbox, monkeypatch):
    parse, states = executor_module._parse_outputs, []

    def recording_parse(stdout, expected_count):
        states.append(gc.isenabled())
        return parse(stdout, expected_count)

    monkeypatch.setattr(executor_module, "_parse_outputs", recording_parse)
    assert sandbox.call("def f():\n    return [[1], [2]]", "f", [()]).outputs[0].value == [[1], [2]]
    assert states == [False] and gc.isenabled()


def test_colliding_set_printed_by_the_candidate_is_an_error_naming_the_bound(sandbox):
    # The attack of issue 21: 40,000 ints with one hash made call() spend 29.8 s parsing after a 0.13 s run.
    document = results({"set": [index * M for index in range(40_000)]}).decode()
    assert len(document) < sandbox.limits.output_bytes
    result = sandbox.call(printing(document), "solve", [()])
    assert result.status is Status.ERROR and result.outputs is None
    assert "share a hash" in result.reason


def test_parsing_counts_in_the_runs_wall_time(sandbox, monkeypatch):
    parse = executor_module._parse_outputs

    def slow_parse(stdout, expected_count):
        time.sleep(1.0)
        return parse(stdout, expected_count)

    monkeypatch.setattr(executor_module, "_parse_outputs", slow_parse)
    limits = Limits(wall_time_s=1.0, memory_bytes=256 * 2**20)
    result = sandbox.call("def f():\n    return 1", "f", [()], limits=limits)
    assert result.status is Status.TIMEOUT and result.outputs is None
    assert "parsing" in result.reason and result.wall_time_s >= 1.0
    # Within the budget, the parse still counts in the run's time.
    result = sandbox.call("def f():\n    return 1", "f", [()])
    assert result.ok and result.wall_time_s >= 1.0


def test_comparison_refuses_keys_crafted_to_collide_only_when_compared(sandbox):
    # A NaN hashes by identity, so these tuples decode fine (no two share a hash); compared NaN-safely, each becomes
    # (int, k * M) and (float, "nan"), and those all collide: building them into one set would go quadratic.
    crafted = "def f():\n    return {(k * 2**61 - k, float('nan')) for k in range(3000)}"
    result = sandbox.call(crafted, "f", [()])
    assert result.ok and len(result.outputs[0].value) == 3000
    expected = {(index * M, nan()) for index in range(3000)}
    assert sandbox.check(crafted, "f", [CallTest((), expected)]) == 0.0
    # Nested collisions are refused in the comparison too, not only in decoding.
    assert not strict_equal(decode_plain({"set": nested_collisions(3)}), decode_plain({"set": nested_collisions(3)}))
    assert strict_equal({(0, nan()), (M, nan())}, {(M, nan()), (0, nan())})  # a few collisions are fine


# NaN keys (issue 21, item 8)


@pytest.mark.parametrize(
    "expected, actual, equal",
    [
        ({nan(): 1}, {nan(): 1}, True),
        ({nan(): 1}, {nan(): 2}, False),
        ({nan(): 1.0}, {nan(): 1.0 + 1e-12}, True),  # values keep their float tolerance
        ({nan(): 1}, {1.0: 1}, False),
        ({nan(): 1, 2: 3}, {2: 3, nan(): 1}, True),
        ({(1, nan()): 1}, {(1, nan()): 1}, True),
        ({(1, nan()): 1}, {(1.0, nan()): 1}, False),  # keys stay exact, types included
        ({frozenset({nan()}): 1}, {frozenset({nan()}): 1}, True),
        ({frozenset({nan()}): 1}, {frozenset({nan(), 1.0}): 1}, False),
        ({(frozenset({nan()}),): [nan()]}, {(frozenset({nan()}),): [nan()]}, True),
        ({nan()}, {nan()}, True),
        ({nan()}, {nan(), 1.0}, False),
        (frozenset({(nan(), frozenset({nan()}))}), frozenset({(nan(), frozenset({nan()}))}), True),
        ({nan(): 1, nan(): 2}, {nan(): 1, nan(): 2}, True),  # two NaN keys: their values pair up in order
        ({nan(): 1, nan(): 2}, {nan(): 1}, False),
    ],
)
def test_strict_equal_matches_nan_keys(expected, actual, equal):
    assert strict_equal(expected, actual) is equal
    assert strict_equal(actual, expected) is equal


def test_nan_key_scores_through_the_sandbox(sandbox):
    source = "def f(x):\n    return {float('nan'): x, (1, float('nan')): frozenset({float('nan')})}"
    tests = [CallTest((1,), {nan(): 1, (1, nan()): frozenset({nan()})}), CallTest((2,), {nan(): 1})]
    assert sandbox.check(source, "f", tests) == 0.5
