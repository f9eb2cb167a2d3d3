"""Episodes for a critic: MAGRPO's turns without its tree, and advantages from a critic's values (docs/critics.md).

`TrajectoryRollout` plays episodes as `TreeRollout` plays them (every scheduled agent acts every turn; transitions,
environments, tools, early termination and `done` as MAGRPO) but each joint action of turn t < T−1 continues in one
child slot, not G: the G copies of a prompt are G trajectories, and a step samples G·N completions per turn instead of
the tree's G^t·N. Where the tree's siblings give each node a Monte-Carlo baseline, a critic's values stand in for it:
`critic_advantages` turns each trajectory's team rewards and values into per-turn advantages and the critic's
targets (`advantages.generalized_advantages`). The rollout is independent of any model: the trainer computes the
values between the two.

Layout, as the tree's: a root node is a prompt group (G slots, which may span processes); a child node has one slot
and one joint action (index 0), on the process that holds its parent. `trajectories` follows each root joint action's
chain of children; a trajectory ends early where the node terminated or the transition said `done`.
"""

from collections.abc import Callable

import torch

from .advantages import generalized_advantages
from .magrpo_rollout import TreeRollout
from .rollout import JointAction, Rollout, RolloutSettings, Sample


class TrajectoryRollout(TreeRollout):
    """One trajectory per prompt copy: MAGRPO's episodes, G copies of a prompt at the root and one continuation of
    every joint action below. Samples and joint actions leave with advantage 0: `critic_advantages` sets them.

    Args:
        settings: as `TreeRollout`'s ([`~trl_marl.RolloutSettings`]).
        num_generations: G, the copies (trajectories) of each prompt.
        discount: γ of the returns the joint actions record (`JointAction.value`, for the logs).
        process_index: this process's rank; part of child node keys.
    """

    def __init__(self, settings: RolloutSettings, num_generations: int, discount: float = 1.0, process_index: int = 0):
        super().__init__(settings, num_generations, "aligned", discount, process_index)
        self.children_per_joint_action = 1

    def _assign_advantages(
        self, samples: list[Sample], joint_actions: list[JointAction], table: list[tuple]
    ) -> list[dict[str, float]]:
        """The logs' per-turn figures over every process's joint actions (`table`); no advantage yet."""
        turn_stats = []
        for turn in range(self.num_turns):
            rows = [entry for entry in table if entry[0] == turn]
            if not rows:
                break
            rewards = torch.tensor([entry[3] for entry in rows], dtype=torch.float32)
            returns = torch.tensor([entry[4] for entry in rows], dtype=torch.float32)
            turn_stats.append(
                {
                    "reward": torch.nanmean(rewards).item(),
                    "return": torch.nanmean(returns).item(),
                    "num_nodes": float(len({entry[1] for entry in rows})),
                    "num_joint_actions": float(len(rows)),
                }
            )
        for sample in samples:
            sample.group = -1  # no group: a trajectory's baseline is the critic's
        return turn_stats


def trajectories(joint_actions: list[JointAction]) -> list[list[int]]:
    """Each trajectory of a process's joint actions (a `TrajectoryRollout`'s), as the indices of its joint actions
    turn by turn, in the order of their roots. Raises ValueError where a joint action has two children (a tree)."""
    child: dict[int, int] = {}
    for index, joint_action in enumerate(joint_actions):
        parent = joint_action.branch.parent
        if parent >= 0:
            if parent in child:
                raise ValueError(
                    f"Joint action {parent} has two children: these joint actions form a tree (MAGRPO's), "
                    "not trajectories. Roll them out with `TrajectoryRollout`."
                )
            child[parent] = index
    chains = []
    for index, joint_action in enumerate(joint_actions):
        if joint_action.branch.parent < 0:
            chain = [index]
            while chain[-1] in child:
                chain.append(child[chain[-1]])
            chains.append(chain)
    return chains


def critic_advantages(
    rollout: Rollout,
    values: torch.Tensor,
    discount: float,
    gae_lambda: float,
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Set every sample's and joint action's advantage from a critic's values, by GAE along each trajectory, and
    return the critic's targets.

    Args:
        rollout: a `TrajectoryRollout`'s (this process's joint actions and samples).
        values: `(J, C)` the critic's value of each joint action's history, before its action, per critic: `C` is the
            number of agents for critics of their own (IAC: column `i` is agent `i`'s critic), 1 for one critic of
            the team (MAAC: every agent's samples take its advantage).
        discount: γ.
        gae_lambda: λ.
        normalize: applied to the `(J, C)` advantages before they reach the samples (e.g. a z-score); None keeps them.

    Returns:
        `(J, C)` the λ-returns, each joint action's critic target. A joint action's `advantage` (for the logs) is the
        mean over its critics of theirs.
    """
    joint_actions = rollout.joint_actions
    if values.shape[0] != len(joint_actions):
        raise ValueError(f"`values` has {values.shape[0]} rows for {len(joint_actions)} joint actions.")
    chains = trajectories(joint_actions)
    turns = max(len(chain) for chain in chains)
    critics = values.shape[1]
    lengths = torch.tensor([len(chain) for chain in chains])
    rewards = torch.zeros(len(chains), turns)
    for row, chain in enumerate(chains):
        rewards[row, : len(chain)] = torch.tensor([joint_actions[j].reward for j in chain]).nan_to_num(0.0)
    advantages, returns = torch.zeros(len(joint_actions), critics), torch.zeros(len(joint_actions), critics)
    for column in range(critics):
        laid_out = torch.zeros(len(chains), turns)
        for row, chain in enumerate(chains):
            laid_out[row, : len(chain)] = values[chain, column].float()
        per_turn, targets = generalized_advantages(rewards, laid_out, lengths, discount, gae_lambda)
        for row, chain in enumerate(chains):
            advantages[chain, column] = per_turn[row, : len(chain)]
            returns[chain, column] = targets[row, : len(chain)]
    if normalize is not None:
        advantages = normalize(advantages)
    at = {(ja.node, ja.index): j for j, ja in enumerate(joint_actions)}
    for j, joint_action in enumerate(joint_actions):
        joint_action.advantage = advantages[j].mean().item()
    for sample in rollout.samples:
        j = at[(sample.node, sample.position)]
        sample.advantage = advantages[j, sample.agent if critics > 1 else 0].item()
    return returns
