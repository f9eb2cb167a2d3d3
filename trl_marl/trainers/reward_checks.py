"""Checks on team reward functions (the built-in rewards themselves live with their tasks, in `trl_marl.tasks`): a
wrapper that turns a bad reward into an error naming the function, the check that a dataset has the columns its
reward functions, local rewards and transition read, and `for_agent`, which makes a plain TRL reward a team reward."""

import asyncio
import concurrent.futures
import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from trl.trainer.utils import get_callable_name, is_async_callable

TeamRewardFunc = Callable[..., list[float | None]]


class RewardFunctionError(RuntimeError):
    """A team reward function raised, or returned something that is not one finite float (or None) per completion."""


def _check_rewards(name: str, rewards: Any, expected: int) -> list[float | None]:
    if not isinstance(rewards, (list, tuple)):
        raise RewardFunctionError(
            f"Team reward function '{name}' returned {type(rewards).__name__}; it must return a list with one float "
            f"(or None) per completion ({expected} expected)."
        )
    if len(rewards) != expected:
        raise RewardFunctionError(
            f"Team reward function '{name}' returned {len(rewards)} rewards for {expected} joint actions; it must "
            "return exactly one reward per completion."
        )
    for index, reward in enumerate(rewards):
        if reward is None:
            continue
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) and not hasattr(reward, "__float__"):
            raise RewardFunctionError(
                f"Team reward function '{name}' returned {reward!r} for joint action {index}; rewards must be floats "
                "(or None when the function does not apply)."
            )
        if not math.isfinite(float(reward)):
            raise RewardFunctionError(
                f"Team reward function '{name}' returned {float(reward)} for joint action {index}. Return a finite "
                "float, or None to mark a completion the function cannot score."
            )
    return list(rewards)


def checked_team_reward(func: TeamRewardFunc, timeout: float | None = None) -> TeamRewardFunc:
    """Wrap a team reward function so that raising, a wrong count, NaN/inf, a non-number, or taking longer than
    `timeout` seconds for one batch is a `RewardFunctionError` naming the function. The wrapper keeps the function's
    name (TRL logs rewards by it) and stays async when the function is.

    Python cannot stop a running thread: a sync function that times out is abandoned in its worker thread (training
    stops with the error, so nothing uses what it returns later)."""
    if isinstance(func, (str, nn.Module)):
        raise TypeError(
            f"Reward model {func!r} cannot score a team: a reward model scores one text, while a team reward takes a "
            "mapping agent name -> completion. Wrap the model in a function `f(prompts, completions, **kwargs)`."
        )
    if not callable(func):
        raise TypeError(f"Team reward {func!r} is not callable.")
    name = get_callable_name(func)

    def timed_out():
        raise RewardFunctionError(
            f"Team reward function '{name}' took longer than reward_timeout={timeout} s for one batch. Make it "
            "faster (e.g. run external work concurrently, or async), or raise reward_timeout."
        )

    def reraise(error: Exception):
        raise RewardFunctionError(f"Team reward function '{name}' raised {type(error).__name__}: {error}") from error

    if is_async_callable(func):

        @functools.wraps(func)
        async def checked_async(*args, **kwargs):
            # The function's own TimeoutError (a remote judge giving up) is an error it raised, not our timeout:
            # the task is awaited by `asyncio.wait`, which never raises on timeout, so the two stay apart.
            task = asyncio.ensure_future(func(*args, **kwargs))
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:
                task.cancel()
                timed_out()
            try:
                rewards = task.result()
            except Exception as error:
                reraise(error)
            return _check_rewards(name, rewards, len(kwargs["prompts"]))

        # `wraps` copies no name from partials or callable instances; TRL logs each reward under this name.
        checked_async.__name__ = checked_async.__qualname__ = name
        return checked_async

    def call(*args, **kwargs):
        if timeout is None:
            return func(*args, **kwargs)
        worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"reward-{name}")
        try:
            future = worker.submit(func, *args, **kwargs)
            done, _ = concurrent.futures.wait([future], timeout=timeout)
            if not done:
                timed_out()
            return future.result()
        finally:
            worker.shutdown(wait=False)

    @functools.wraps(func)
    def checked(*args, **kwargs):
        try:
            rewards = call(*args, **kwargs)
        except RewardFunctionError:
            raise
        except Exception as error:
            reraise(error)
        return _check_rewards(name, rewards, len(kwargs["prompts"]))

    checked.__name__ = checked.__qualname__ = name
    return checked


def for_agent(reward_func: Callable[..., list[float | None]], agent: str) -> TeamRewardFunc:
    """A team reward that applies a plain TRL reward function to one agent's completions.

    TRL reward functions take completions as strings (standard datasets) or as assistant message lists
    (conversational ones); the team reward hands them `agent`'s completions in the format matching the prompts, and
    that agent's `completion_ids`. Its name is `"<function>[<agent>]"`, under which TRL logs it.
    """
    name = f"{get_callable_name(reward_func)}[{agent}]"

    def agent_reward(prompts, completions, completion_ids=None, **kwargs):
        conversational = bool(prompts) and isinstance(prompts[0], list)
        texts = [completion[agent] for completion in completions]
        if conversational:
            texts = [[{"role": "assistant", "content": text}] for text in texts]
        ids = [row[agent] for row in completion_ids] if completion_ids is not None else None
        return reward_func(prompts=prompts, completions=texts, completion_ids=ids, **kwargs)

    agent_reward.__name__ = agent_reward.__qualname__ = name
    return agent_reward


# What the trainer passes besides the dataset columns: to team rewards
# (`scoring.TeamScoring.score`), to local rewards (`ATGRPOTrainer._local_scores`) and to
# transitions (`TreeRollout._next_turn`).
TEAM_REWARD_ARGUMENTS = frozenset(
    {
        "prompts",
        "completions",
        "completion_ids",
        "turn",
        "history",
        "state",
        "environments",  # with `environment_factory=`: each joint action's episode environment
        "trainer_state",
        "log_extra",
        "log_metric",
    }
)
LOCAL_REWARD_ARGUMENTS = frozenset({"prompts", "completions", "turn", "state"})
TRANSITION_ARGUMENTS = frozenset({"prompt", "joint_action", "history", "turn", "observations", "reward", "state"})


def required_columns(func: Callable, provided: Iterable[str]) -> list[str]:
    """The parameters of `func` without a default that the trainer does not provide: dataset columns it needs."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return []
    positional = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    needed = [p for p in parameters if p.kind in positional and p.default is inspect.Parameter.empty]
    return [p.name for p in needed if p.name not in provided]


def check_dataset_columns(dataset: Any, consumers: list[tuple[str, Callable, frozenset]], dataset_name: str) -> None:
    """Raise a `ValueError` naming the column when `dataset` lacks `prompt`, or a column that one of `consumers`
    (`(kind, function, arguments the trainer provides)`) needs, naming the function. Datasets without known columns
    are not checked."""
    columns = getattr(dataset, "column_names", None)
    if not columns:
        return
    if "prompt" not in columns:
        raise ValueError(
            f"The {dataset_name} has no `prompt` column (its columns: {sorted(columns)}): every row needs its prompt, "
            "a string or a list of chat messages, in a column named `prompt` (e.g. "
            "`dataset.rename_column('question', 'prompt')`)."
        )
    for kind, func, provided in consumers:
        missing = [name for name in required_columns(func, provided) if name not in columns]
        if missing:
            raise ValueError(
                f"{kind} '{get_callable_name(func)}' reads the dataset column(s) {missing}, which the {dataset_name} "
                f"lacks (its columns: {sorted(columns)}). Add the column(s) to every row, use the task's own dataset "
                "(`task.dataset(split)`), or give the parameter a default."
            )
