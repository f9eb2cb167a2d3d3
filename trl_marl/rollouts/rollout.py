"""What both rollouts share: the settings they are built from, the records of an episode (branches, samples,
joint actions, the rollout's result) and the transition contract (`NextTurn`, `checked_next_turn`).

A rollout is independent of any model: the trainer passes it `generate`, `score` and `gather`, so the same code trains,
runs a saved team (`load_team`) and is tested with stand-ins.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from trl.trainer.utils import get_callable_name

from .scheduling import Prompt, Said, parallel, scheduled_phases

NodeKey = tuple[int, int, int]


@dataclass
class RolloutSettings:
    """What a rollout takes from the trainer's config and task, built once per trainer (`TeamTrainer.__init__`) and
    passed to either algorithm's rollout with that algorithm's own settings.

    Args:
        agent_names: the agents, in order.
        num_turns: T.
        reward_weights: `(F,)` weights of the team reward functions.
        baseline, scale_rewards: as [`~trl_marl.rollouts.advantages.group_advantages`].
        transition: `f(prompt, joint_action, history, turn, observations, reward, **columns)` → each agent's next
            prompt (see [`checked_next_turn`]); AT-GRPO's also receives `state` when the task keeps one.
        agent_input: `f(agent_index, prompt)` → the model input of that agent (its role added).
        scheduler: which agents act at each turn and what each sees (`trl_marl.rollouts.scheduling`); `parallel` by
        default. termination_threshold: early termination on the team reward (each rollout says how); `None` for never.
        reset: `f(example)` → a problem's initial environment state (None: the task keeps none).
        step: `f(state, agent_name, text, turn)` → the state after that agent said `text` (on a private copy).
        success: `f(example, state, completions)` → whether an episode succeeded, or None when undefined (AT-GRPO).
        environment: `f(example)` → `(environment, observation)`: a new episode's own environment, reset with the
            row (`environment_factory=`, `tool_calling.py`), and what its `reset` returned (None, or text added to
            the task prompt); None without one.
    """

    agent_names: list[str]
    num_turns: int
    reward_weights: torch.Tensor
    baseline: str
    scale_rewards: str
    transition: Callable
    agent_input: Callable[[int, Prompt], Any]
    scheduler: Any = parallel
    termination_threshold: float | None = None
    reset: Callable[[dict], Any] | None = None
    step: Callable[..., Any] | None = None
    success: Callable[..., bool | None] | None = None
    environment: Callable[[dict], tuple[Any, Any]] | None = None

    @property
    def num_agents(self) -> int:
        return len(self.agent_names)

    @classmethod
    def from_config(cls, args: Any, task: Any, **values) -> "RolloutSettings":
        """The settings of a `TeamConfig` and an optional `Task` (its environment hooks); `values` gives the rest."""
        hooks = {name: getattr(task, name) for name in ("reset", "step", "success")} if task is not None else {}
        return cls(
            agent_names=args.agent_names,
            num_turns=args.num_turns,
            termination_threshold=args.termination_threshold,
            **hooks,
            **values,
        )


class EpisodeRollout:
    """What both rollouts hold: their settings, G, and the scheduler's phases of every turn."""

    def __init__(self, settings: RolloutSettings, num_generations: int):
        self.settings = settings
        self.agent_names = settings.agent_names
        self.num_agents = settings.num_agents
        self.num_generations = num_generations
        self.num_turns = settings.num_turns
        self.scheduler = settings.scheduler
        self.reset = settings.reset or (lambda example: None)
        self.environment = settings.environment
        self.phases = scheduled_phases(self.scheduler, self.num_agents, self.num_turns)


class Generated(NamedTuple):
    """What a rollout's `generate` hook returns, per row: the prompt's ids, the completion's ids and text, and (when
    the row's agent called tools) its tool mask: 0 on the tokens of tool results, 1 on the model's own."""

    prompt_ids: list
    completion_ids: list
    texts: list
    tool_masks: list | None = None


def generated_rows(result: tuple) -> Generated:
    """A `generate` hook's result as `Generated` (a plain `(prompt_ids, completion_ids, texts)` has no tool masks)."""
    return result if isinstance(result, Generated) else Generated(*result)


def with_observation(prompt: Prompt, observation: Any) -> Prompt:
    """The task prompt with what an environment's `reset` returned added to it, as TRL adds it: to the last message's
    content (or the text)."""
    if observation is None:
        return prompt
    if isinstance(prompt, str):
        return prompt + str(observation)
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + str(observation)}]


class TransitionError(RuntimeError):
    """A transition raised, or did not return one next prompt per agent."""


@dataclass
class NextTurn:
    """What a transition returns for one branch: each agent's next prompt (a string or a list of chat messages, in the
    dataset's prompt format), or `done=True` to end the episode after this turn."""

    prompts: Sequence[Prompt] | dict[str, Prompt] | None = None
    done: bool = False


@dataclass
class Sample:
    """One agent's completion at one node: one training row."""

    turn: int
    node: NodeKey
    position: int
    agent: int
    model_input: Prompt  # what the model was given (role included)
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    advantage: float = 0.0
    group: int = -1  # global index of the node (in sorted node-key order), the same on every process
    example: dict = field(default_factory=dict, repr=False)  # the dataset row
    tool_mask: list[int] | None = None  # 0 on tool results' tokens (out of the loss), when the agent called tools


@dataclass
class JointAction:
    turn: int
    node: NodeKey
    index: int  # k within the node
    branch: Any  # the path it continues: a MAGRPO tree's `TreeBranch`, or AT-GRPO's `EpisodeBranch`
    completions: dict[str, str]  # every agent's latest answer: what the team reward scores
    completion_ids: dict[str, list[int]]
    said: Said = field(default_factory=dict)  # the acting agents' answers of this turn
    rewards_per_func: list[float] = field(default_factory=list)
    reward: float = math.nan
    value: float = math.nan  # the return R
    advantage: float = 0.0
    done: bool = False  # the transition ended the episode here
    terminated: bool = False  # early termination: its node's mean reward reached the threshold
    state: Any = None  # AT-GRPO: the task's environment state after this action (a private copy)
    environment: Any = None  # the episode's environment (`environment_factory=`) after this action, its own copy


@dataclass
class Rollout:
    """A process's samples and joint actions, and per-turn statistics of the whole (all processes) batch."""

    samples: list[Sample]
    joint_actions: list[JointAction]
    turn_stats: list[dict[str, float]]  # per turn: reward, return, zero-std fraction, node / joint-action counts
    batch_rewards_per_func: torch.Tensor  # (J_all, F) over every process's joint actions
    batch_turns: torch.Tensor  # (J_all,)
    metrics: dict[str, float] = field(default_factory=dict)  # algorithm-specific statistics, already over processes


def default_transition(prompt: Prompt, observations: dict[str, Prompt], **kwargs) -> list[Prompt]:
    """No feedback: every agent gets the task prompt again. What was said reaches it through the scheduler (by
    default `parallel`: the task followed by every earlier turn's answers)."""
    return [prompt] * len(observations)


def transition_name(transition: Callable) -> str:
    return get_callable_name(transition)


def checked_next_turn(name: str, result: Any, agent_names: list[str], turn: int) -> tuple[list[Prompt], bool]:
    """Normalise what a transition returned to `(one prompt per agent, done)`, or raise `TransitionError`."""
    if isinstance(result, NextTurn):
        if result.done:
            return [], True
        result = result.prompts
    expected = f"{len(agent_names)} prompts, one per agent {agent_names}"
    if isinstance(result, dict):
        if sorted(result) != sorted(agent_names):
            raise TransitionError(
                f"Transition '{name}' returned prompts for agents {sorted(result)} after turn {turn}; expected "
                f"{expected}."
            )
        prompts = [result[agent] for agent in agent_names]
    elif isinstance(result, (list, tuple)):
        if len(result) != len(agent_names):
            raise TransitionError(
                f"Transition '{name}' returned {len(result)} prompts after turn {turn}; expected {expected}."
            )
        prompts = list(result)
    else:
        raise TransitionError(
            f"Transition '{name}' returned {type(result).__name__} after turn {turn}; it must return a list of "
            f"{expected}, a dict agent name -> prompt, or trl_marl.NextTurn(prompts=..., done=...)."
        )
    for agent, prompt in zip(agent_names, prompts):
        if (
            not isinstance(prompt, (str, list))
            or isinstance(prompt, list)
            and not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
        ):
            raise TransitionError(
                f"Transition '{name}' returned {prompt!r} as the prompt of agent '{agent}' after turn {turn}; a "
                "prompt is a string or a list of {'role', 'content'} messages."
            )
    return prompts, False
