"""Specification of `checked_team_reward` (a bad team reward becomes a `RewardFunctionError` naming the function), of
the built-in team rewards, and of `for_agent` (a TRL reward applied to one agent).

Wrappers are called as TRL's GRPOTrainer calls reward functions: keyword arguments `prompts`, `completions` (here one
mapping agent name -> completion per joint action) and `completion_ids`.
"""

import asyncio
import functools
import inspect

import pytest
import torch
from trl.trainer.utils import get_callable_name, is_async_callable

from trl_marl.trainers.reward_checks import RewardFunctionError, checked_team_reward

PROMPTS = ["Say hi.", "Say bye."]
COMPLETIONS = [{"a": "hi", "b": "hello"}, {"a": "bye", "b": "farewell"}]
COMPLETION_IDS = [[[1], [2]], [[3], [4]]]


def call(wrapped):
    return wrapped(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=COMPLETION_IDS)


def test_valid_rewards_pass_through():
    def length_gap(prompts, completions, **kwargs):
        return [float(len(c["b"]) - len(c["a"])) for c in completions]

    # len("hello") - len("hi") = 3;  len("farewell") - len("bye") = 5
    assert call(checked_team_reward(length_gap)) == [3.0, 5.0]


def test_none_rewards_pass_through_unchanged():
    def partial_judge(prompts, completions, **kwargs):
        return [None, 1.0]

    assert call(checked_team_reward(partial_judge)) == [None, 1.0]


def test_raising_function_is_named_and_chained():
    original = KeyError("missing agent 'c'")

    def needs_agent_c(prompts, completions, **kwargs):
        raise original

    with pytest.raises(RewardFunctionError) as error:
        call(checked_team_reward(needs_agent_c))
    assert "needs_agent_c" in str(error.value)
    assert "KeyError" in str(error.value)
    assert "missing agent 'c'" in str(error.value)
    assert error.value.__cause__ is original


def test_wrong_number_of_rewards_is_reported_with_both_counts():
    def one_too_many(prompts, completions, **kwargs):
        return [1.0, 2.0, 3.0]

    with pytest.raises(RewardFunctionError) as error:
        call(checked_team_reward(one_too_many))
    assert "'one_too_many' returned 3 rewards for 2 joint actions" in str(error.value)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_names_function_and_joint_action_and_suggests_none(bad_value):
    def unstable(prompts, completions, **kwargs):
        return [0.5, bad_value]

    with pytest.raises(RewardFunctionError) as error:
        call(checked_team_reward(unstable))
    message = str(error.value)
    assert "'unstable'" in message
    assert f"returned {bad_value} for joint action 1" in message
    assert "None" in message


def test_non_number_reward_is_rejected():
    def verdict(prompts, completions, **kwargs):
        return ["good", 1.0]

    with pytest.raises(RewardFunctionError) as error:
        call(checked_team_reward(verdict))
    assert "'verdict' returned 'good' for joint action 0" in str(error.value)
    assert "must be floats" in str(error.value)


def test_reward_that_is_not_a_list_is_rejected():
    def total(prompts, completions, **kwargs):
        return 2.0

    with pytest.raises(RewardFunctionError) as error:
        call(checked_team_reward(total))
    assert "'total' returned float" in str(error.value)
    assert "2 expected" in str(error.value)


def test_wrapper_keeps_the_function_name():
    def agreement(prompts, completions, **kwargs):
        return [1.0] * len(prompts)

    wrapped = checked_team_reward(agreement)
    assert wrapped.__name__ == "agreement"
    assert get_callable_name(wrapped) == "agreement"


def test_wrapper_of_callable_instance_is_named_after_its_class():
    # TRL logs rewards under get_callable_name(reward_func): a callable instance is named after its class.
    class Agreement:
        def __call__(self, prompts, completions, **kwargs):
            return [1.0] * len(prompts)

    assert get_callable_name(checked_team_reward(Agreement())) == "Agreement"


def test_wrapper_of_partial_is_named_after_the_wrapped_function():
    def scaled(prompts, completions, scale, **kwargs):
        return [scale] * len(prompts)

    wrapped = checked_team_reward(functools.partial(scaled, scale=2.0))
    assert call(wrapped) == [2.0, 2.0]
    assert get_callable_name(wrapped) == "scaled"


def test_async_function_stays_async_and_returns_its_rewards():
    async def remote_judge(prompts, completions, **kwargs):
        return [0.25, 0.75]

    wrapped = checked_team_reward(remote_judge)
    assert inspect.iscoroutinefunction(wrapped)
    assert is_async_callable(wrapped)
    assert wrapped.__name__ == "remote_judge"
    assert asyncio.run(call(wrapped)) == [0.25, 0.75]


def test_async_function_bad_reward_is_checked():
    async def remote_judge(prompts, completions, **kwargs):
        return [0.25, float("nan")]

    with pytest.raises(RewardFunctionError, match="'remote_judge' returned nan for joint action 1"):
        asyncio.run(call(checked_team_reward(remote_judge)))


@pytest.mark.parametrize("timeout", [None, 30.0], ids=["no-timeout", "timeout"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_function_raising_timeout_error_is_named_and_chained_not_a_reward_timeout(is_async, timeout):
    # The function's own TimeoutError (a judge giving up) is its error, not reward_timeout running out.
    original = TimeoutError("judge did not answer")

    def judge(prompts, completions, **kwargs):
        raise original

    async def remote_judge(prompts, completions, **kwargs):
        raise original

    wrapped = checked_team_reward(remote_judge if is_async else judge, timeout)
    with pytest.raises(RewardFunctionError) as error:
        asyncio.run(call(wrapped)) if is_async else call(wrapped)
    name = "remote_judge" if is_async else "judge"
    assert str(error.value) == f"Team reward function '{name}' raised TimeoutError: judge did not answer"
    assert error.value.__cause__ is original


@pytest.mark.parametrize("reward_model", ["org/reward-model", torch.nn.Linear(2, 1)])
def test_reward_model_is_rejected_because_team_rewards_take_a_mapping(reward_model):
    with pytest.raises(TypeError) as error:
        checked_team_reward(reward_model)
    assert "cannot score a team" in str(error.value)
    assert "mapping agent name -> completion" in str(error.value)
    assert "f(prompts, completions, **kwargs)" in str(error.value)


def test_non_callable_is_rejected():
    with pytest.raises(TypeError, match="not callable"):
        checked_team_reward(3.0)


# built-in team rewards and the TRL adapter


def test_answer_match_is_the_share_of_agents_naming_the_answer_as_a_word():
    from trl_marl.tasks.toy import answer_match

    completions = [{"a": "It is 12.", "b": "112"}, {"a": "twelve", "b": "Twelve!"}]
    # "112" does not contain 12 as a whole word; matching ignores case
    assert answer_match(["q1", "q2"], completions, answer=["12", "twelve"]) == [0.5, 1.0]


def test_word_budget_is_the_share_of_non_empty_answers_within_the_limit():
    from trl_marl.tasks.toy import word_budget

    completions = [{"a": "one two three", "b": ""}, {"a": "one two", "b": "one two three four"}]
    assert word_budget(["q", "q"], completions, word_limit=[3, 3]) == [0.5, 0.5]


def test_for_agent_applies_a_trl_reward_to_one_agents_completions_in_the_prompts_format():
    from trl_marl import for_agent

    seen = {}

    def trl_length_reward(prompts, completions, completion_ids, **kwargs):  # a plain TRL reward function
        seen.update(completions=completions, completion_ids=completion_ids, kwargs=kwargs)
        return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]

    reward = for_agent(trl_length_reward, "b")
    assert reward.__name__ == "trl_length_reward[b]"
    prompts = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]]
    ids = [{"a": [1], "b": [2, 5]}, {"a": [3], "b": [4]}]  # per joint action: agent name -> token ids
    values = reward(prompts=prompts, completions=COMPLETIONS, completion_ids=ids, topic=["x", "y"])
    assert values == [5.0, 8.0]  # len("hello"), len("farewell")
    assert seen["completions"] == [
        [{"role": "assistant", "content": "hello"}],
        [{"role": "assistant", "content": "farewell"}],
    ]
    assert seen["completion_ids"] == [[2, 5], [4]]
    assert seen["kwargs"] == {"topic": ["x", "y"]}
    # standard (string) prompts get string completions
    assert reward(prompts=["hi", "bye"], completions=COMPLETIONS, completion_ids=None) is not None
    assert seen["completions"] == ["hello", "farewell"]
