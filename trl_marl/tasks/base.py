"""The `Task` base class of task plugins: everything a team needs to train on one problem family (docs/design.md §9.2).

A task bundles the agents' roles, its dataset (with an offline default), how the prompt reaches each agent between
turns (its `transition`: feedback and termination), the turn scheduler, and its default team rewards. Subclass
`Task`, set the class attributes, implement `dataset`, and register it under the entry-point group `trl_marl.tasks`
(or with `trl_marl.register_task`). `MAGRPOTrainer(task=...)` and `trl-marl train` accept a task by name or object.
"""

import inspect
from typing import Any

from datasets import Dataset

from ..rollouts.rollout import default_transition


class Task:
    """Base class of task plugins; a subclass sets the attributes and implements `dataset`."""

    name: str = ""
    agents: list[dict] = []  # {"name", "system_prompt"} per agent, in order
    num_turns: int = 1
    scheduler: str = "parallel"
    reward_funcs: list = []  # default team rewards: callables or reward plugin names
    # Local rewards: agent name -> TRL-style reward functions scoring that agent's own completions (strings). MAGRPO
    # trains on the team reward and logs these as `agents/<name>/local_reward`; AT-GRPO adds them to α · team reward.
    local_reward_funcs: dict[str, list] = {}

    def dataset(self, split: str = "train") -> Dataset:
        """The task's data, available offline; `split` is "train" or "eval"."""
        raise NotImplementedError(f"Task {type(self).__name__} must implement `dataset(split)`.")

    # An environment with state. The state must be deep-copyable (and, for AT-GRPO on several processes, picklable):
    # every branch holds its own copy. MAGRPO steps a joint action's copy once per acting agent, in agent order;
    # AT-GRPO steps each candidate's copy and continues from the chosen one.

    def reset(self, example: dict) -> Any:
        """The episode's initial state for a dataset row; it must depend on the row only (every copy of a problem
        starts from it). Default: None, no state."""
        return None

    def step(self, state: Any, agent: str, action: str, turn: int) -> Any:
        """The state after `agent` said `action` at `turn`. `state` is a private copy: change it and return it, or
        return a new one. Reward functions and the transition receive it as `state`."""
        return state

    def success(self, example: dict, state: Any, completions: dict[str, str]) -> bool | None:
        """Whether a finished episode succeeded (logged as `episodes/success_rate`), from its final state and every
        agent's latest answer; None (the default) when the task does not define success."""
        return None

    def transition(self, **kwargs) -> Any:
        """Each agent's next prompt (feedback) or `NextTurn(done=True)`; see `trl_marl.NextTurn`. Default: the
        task prompt again."""
        return default_transition(**kwargs)


def local_rewards(task: Task, agent: str, prompts: list, completions: list[str], **kwargs) -> list[float] | None:
    """The sum of `agent`'s local reward functions over its completions, or None when the task gives it none."""
    funcs = task.local_reward_funcs.get(agent, [])
    if not funcs:
        return None
    totals = [0.0] * len(completions)
    for func in funcs:
        values = func(prompts=prompts, completions=completions, **kwargs)
        if len(values) != len(completions):
            raise ValueError(
                f"Local reward '{getattr(func, '__name__', func)}' of agent '{agent}' returned {len(values)} values "
                f"for {len(completions)} completions."
            )
        totals = [total + float(value) for total, value in zip(totals, values)]
    return totals


def resolve_task(task: "str | Task | type[Task]", **options: Any) -> Task:
    """A task object from a plugin name, a `Task` subclass or instance. `options` go to the task's constructor (e.g.
    `source="hub"` for a task that can load the paper's Hub data); an instance takes none."""
    if isinstance(task, str):
        from ..registry import load_plugin

        task = load_plugin("tasks", task)
    if isinstance(task, type):
        if options:
            try:
                inspect.signature(task).bind(**options)
            except TypeError as error:
                raise TypeError(
                    f"Task {task.__name__!r} does not take the options {sorted(options)} ({error}); its constructor "
                    f"is {task.__name__}{inspect.signature(task)}."
                ) from None
        task = task(**options)
    elif options:
        raise TypeError(f"Options {sorted(options)} need a task name or class, not the built task {task!r}.")
    if not isinstance(task, Task):
        raise TypeError(f"{task!r} is not a trl_marl Task: subclass trl_marl.Task and implement `dataset(split)`.")
    return task


def task_defaults(task: Task) -> dict:
    """The `MAGRPOConfig` fields a task sets: its agents, turns and scheduler."""
    return {"agents": [dict(agent) for agent in task.agents], "num_turns": task.num_turns, "scheduler": task.scheduler}
