"""MAGRPO over agent programs: the episodes of an episode function, grouped, scored and credited as MAGRPO's
single-turn aligned rollout credits its joint actions (docs/programs.md, docs/design.md §5).

A group is the G copies of one dataset row (the sampler's layout, as `TreeRollout`'s root nodes): each copy is one
episode, in which the program called the agents as it liked. An episode is one joint action of its group: its outcome
(a float, or a mapping for the reward functions) gives one team reward, the group's rewards give each episode its
advantage (`advantages.node_credit`, aligned, with the trainer's `baseline` and `scale_rewards`), and every completion
any agent produced in the episode is a training row with that advantage: an agent called k times adds k rows, an agent
not called adds none. An episode that raised or timed out is left out of its group (no reward, no rows) and counted;
a group left with fewer than two scored episodes gives no gradient and is counted too. When more than
`max_failed_fraction` of a step's episodes fail, training stops (`EpisodesFailed`): a program that cannot run would
otherwise train nothing, step after step, with only warnings to show for it.

Like the other rollouts it is independent of any model: the trainer passes `run_episodes` (the programs run against
its server, `episode_runner.EpisodeRunner`), `score` and `gather`.
"""

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.trainer.utils import nanstd

from .advantages import node_credit, team_rewards
from .magrpo_rollout import TreeBranch
from .rollout import EpisodeRollout, JointAction, Rollout, Sample
from .rows import _local, check_group_layout

# The dataset column through which a float outcome reaches the team reward (`episode_outcome`).
OUTCOME_COLUMN = "episode_outcome"

logger = logging.getLogger("trl_marl")


class EpisodesFailed(RuntimeError):
    """More of a step's episodes failed than `episode_max_failed_fraction` allows; names the first and its cause."""


@dataclass
class RecordedCall:
    """One completion an agent produced in an episode: a training row.

    Args:
        agent: the agent's index.
        prompt: what the request sent (chat messages, or the prompt text).
        prompt_ids: the prompt as the model saw it (the agent's role and chat template applied).
        completion_ids: the sampled completion (its end-of-sequence token kept, as `Team` keeps it).
        logprobs: each completion token's log-probability at sampling time, as the sampler gave it: on the
            transformers path before temperature; on the trainer's vLLM engine after temperature and top-p (what
            TRL's importance-sampling correction compares with the trainer's).
        text: the completion's text as the program received it.
        finish_reason: "stop" or "length".
    """

    agent: int
    prompt: Any
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


@dataclass
class EpisodeResult:
    """One episode: what the program returned (`outcome`: a float or a mapping) or why it is left out (`error`),
    and the calls it made (`RecordedCall`)."""

    outcome: Any = None
    calls: list[RecordedCall] = field(default_factory=list)
    error: str | None = None


def episode_outcome(prompts, completions, **kwargs) -> list[float | None]:
    """The team reward of episodes that return a float: that float (None, "does not apply", for an episode that
    returned a mapping). The trainer's reward when an episode function is given without reward functions."""
    return list(kwargs[OUTCOME_COLUMN])


def checked_outcome(outcome: Any) -> tuple[Any, str | None]:
    """`(outcome, None)` for a float or a mapping, else `(None, why)`."""
    if isinstance(outcome, Mapping):
        return dict(outcome), None
    if isinstance(outcome, (int, float)) and not isinstance(outcome, bool) and math.isfinite(outcome):
        return float(outcome), None
    return None, (
        f"returned {outcome!r} ({type(outcome).__name__}); an episode returns a finite float (the team reward) or a "
        "mapping that goes to the reward functions as the completion"
    )


class ProgramRollout(EpisodeRollout):
    """Runs one batch of episodes and assigns their rewards and advantages.

    Args:
        settings: the trainer's `RolloutSettings` (agents, reward weights, baseline, scaling).
        num_generations: G, episodes per dataset row.
        scores_floats: the reward functions include `episode_outcome` (a float outcome is a team reward).
        scores_mappings: the reward functions include others (they score a mapping outcome). An episode whose
            outcome nothing scores is left out, its error saying what to change.
        max_failed_fraction: the largest share of a step's episodes (every process's) that may fail; more raises
            `EpisodesFailed` (1.0: never).
    """

    def __init__(
        self,
        settings,
        num_generations: int,
        scores_floats: bool = True,
        scores_mappings: bool = True,
        max_failed_fraction: float = 1.0,
    ):
        super().__init__(settings, num_generations)
        self.scores_floats, self.scores_mappings = scores_floats, scores_mappings
        self.max_failed_fraction = max_failed_fraction

    def run(
        self,
        examples: list[dict],
        first_copy: int,
        run_episodes: Callable[[list[dict]], list[EpisodeResult]],
        score: Callable[[list[JointAction]], torch.Tensor],
        gather: Callable[[list], list] = _local,
    ) -> Rollout:
        """The rollout of this process's prompt copies (`examples`, G consecutive copies per row; `first_copy`: the
        global index of the first)."""
        num_generations = self.num_generations
        check_group_layout(examples, first_copy, num_generations, gather)
        results = [self._checked(result) for result in run_episodes(examples)]
        errors = Counter(result.error for result in results if result.error is not None)
        for error, count in errors.most_common(3):
            logger.warning("%d of %d episodes left out: the episode %s", count, len(results), error)
        joint_actions = []
        for row, (example, result) in enumerate(zip(examples, results)):
            copy = first_copy + row
            outcome = result.outcome
            columns = {**example, OUTCOME_COLUMN: outcome if isinstance(outcome, float) else None}
            branch = TreeBranch(columns, [], [], -1)
            said = {self.agent_names[call.agent]: call.text for call in result.calls}  # each agent's last answer
            completions = outcome if isinstance(outcome, dict) else said
            node = (0, -1, copy // num_generations)
            joint_actions.append(JointAction(0, node, copy % num_generations, branch, completions, {}, said))
        scored = [ja for ja, result in zip(joint_actions, results) if result.error is None]
        num_funcs = len(self.settings.reward_weights)
        for joint_action in joint_actions:
            joint_action.rewards_per_func = [math.nan] * num_funcs
        if scored:
            rewards_per_func = score(scored)
            rewards = team_rewards(rewards_per_func, self.settings.reward_weights)
            for joint_action, per_func, reward in zip(scored, rewards_per_func.tolist(), rewards.tolist()):
                joint_action.rewards_per_func, joint_action.reward = per_func, reward
        table = gather([(ja.node, ja.index, ja.reward, ja.rewards_per_func) for ja in joint_actions])
        failed = gather([(first_copy + row, r.error) for row, r in enumerate(results) if r.error is not None])
        self._stop_if_too_many_failed(failed, len(table))
        calls = gather([len(result.calls) for result in results if result.error is None])
        turn_stats, credit_of, group_of, silent = self._credit(table)
        samples = []
        for joint_action, result, example in zip(joint_actions, results, examples):
            joint_action.value = joint_action.reward
            joint_action.advantage = credit_of[joint_action.node][joint_action.index].item()
            if result.error is not None:
                continue
            group = group_of[joint_action.node]
            for call in result.calls:
                sample = Sample(
                    0, joint_action.node, joint_action.index, call.agent, call.prompt, call.prompt_ids,
                    call.completion_ids, call.text, joint_action.advantage, group, example,
                )  # fmt: skip
                samples.append(sample)
        batch_rewards_per_func = torch.tensor([entry[3] for entry in table]).view(len(table), -1)
        metrics = {
            "episodes/failed": float(len(failed)),
            "episodes/calls_mean": sum(calls) / len(calls) if calls else 0.0,
            "episodes/groups_without_signal": float(silent),
        }
        return Rollout(
            samples, joint_actions, turn_stats, batch_rewards_per_func, torch.zeros(len(table), dtype=torch.long),
            metrics,
        )  # fmt: skip

    def _stop_if_too_many_failed(self, failed: list[tuple[int, str]], episodes: int) -> None:
        """Raise `EpisodesFailed` when more than `max_failed_fraction` of the step's `episodes` failed (`failed`: every
        process's `(prompt copy, error)`), naming the first failed episode and its cause."""
        if not episodes or len(failed) <= self.max_failed_fraction * episodes:
            return
        copy, error = min(failed)
        raise EpisodesFailed(
            f"{len(failed)} of the step's {episodes} episodes failed, more than `episode_max_failed_fraction` "
            f"({self.max_failed_fraction:g}) allows, so training stops before it trains on what is left (nothing of "
            f"this step was trained; saved checkpoints are untouched). The first, episode {copy} (dataset row "
            f"{copy // self.num_generations}, episode {copy % self.num_generations + 1} of its "
            f"{self.num_generations}): the episode {error}. Fix the program (or what the server refused), or raise "
            "`episode_max_failed_fraction` to train on the episodes that succeed."
        )

    def _checked(self, result: EpisodeResult) -> EpisodeResult:
        """The result, or a failed one when nothing scores its outcome."""
        if result.error is None and isinstance(result.outcome, float) and not self.scores_floats:
            why = (
                "returned a float, but the trainer's reward functions score mappings: return the agents' answers as "
                "a mapping, or give no reward functions so that the float is the team reward"
            )
        elif result.error is None and isinstance(result.outcome, dict) and not self.scores_mappings:
            why = (
                "returned a mapping, but the trainer has no reward function to score it: return the team reward as a "
                "float, or give reward functions"
            )
        else:
            return result
        return EpisodeResult(None, [], why)

    def _credit(self, table: list[tuple]) -> tuple[list[dict], dict, dict, int]:
        """Each group's advantages from the rewards of every process's episodes (a group may span processes); a group
        with fewer than two scored episodes gets none."""
        nodes = sorted({entry[0] for entry in table})
        index_of = {node: i for i, node in enumerate(nodes)}
        rewards = torch.full((len(nodes), self.num_generations), math.nan)
        for node, index, reward, _ in table:
            rewards[index_of[node], index] = reward
        all_rewards = rewards.flatten()
        batch_std = nanstd(all_rewards) if all_rewards.numel() > 1 else torch.zeros(())
        _, advantages, std = node_credit(
            rewards, "aligned", self.num_agents, self.num_generations, self.settings.baseline,
            self.settings.scale_rewards, batch_std,
        )  # fmt: skip
        without_signal = (~torch.isnan(rewards)).sum(dim=1) < 2
        advantages[without_signal] = 0.0
        turn_stats = [
            {
                "reward": torch.nanmean(rewards).item(),
                "return": torch.nanmean(rewards).item(),
                "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
                "num_nodes": float(len(nodes)),
                "num_joint_actions": float(len(table)),
            }
        ]
        credit_of = {node: advantages[i] for node, i in index_of.items()}
        return turn_stats, credit_of, index_of, int(without_signal.sum())
