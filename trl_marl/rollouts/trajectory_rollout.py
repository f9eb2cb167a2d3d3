"""Episodes for a critic: MAGRPO's turns without its tree, and advantages from a critic's values (docs/critics.md).

`TrajectoryRollout` plays episodes as `TreeRollout` plays them (every scheduled agent acts every turn; transitions,
environments, tools and `done` as MAGRPO) but each joint action of turn t < T−1 continues in one child slot, not G.
Early termination is per trajectory (its own reward reached `termination_threshold`), where MAGRPO's is per node (the
mean of its G siblings'); CoMLRL's actor-critic trainers, with one episode per prompt, end an episode on its own
reward too. So the G copies of a prompt are G trajectories, and a step samples G·N completions per turn instead of
the tree's G^t·N. Where the tree's siblings give each node a Monte-Carlo baseline, a critic's values stand in for it:
`critic_advantages` turns each trajectory's team rewards and values into per-turn advantages and the critic's
targets (`advantages.generalized_advantages`). The rollout is independent of any model: the trainer computes the
values between the two.

Layout, as the tree's: a root node is a prompt group (G slots, which may span processes); a child node has one slot
and one joint action (index 0), on the process that holds its parent. `trajectories` follows each root joint action's
chain of children; a trajectory ends early where the node terminated or the transition said `done`.
"""

import math
from collections import defaultdict
from collections.abc import Callable

import torch

from .advantages import generalized_advantages
from .magrpo_rollout import TreeRollout
from .rollout import JointAction, Rollout, RolloutSettings, Sample
from .scheduling import Prompt


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

    def _terminated_nodes(self, joint_actions: list[JointAction], gather: Callable) -> set[tuple]:
        """The joint actions (as `(node, index)`) whose own team reward reached the threshold."""
        threshold = self.settings.termination_threshold
        if threshold is None:
            return set()
        return {(ja.node, ja.index) for ja in joint_actions if ja.reward == ja.reward and ja.reward >= threshold}

    def _stopped(self, joint_action: JointAction, stopped: set) -> bool:
        return (joint_action.node, joint_action.index) in stopped

    def _assign_advantages(
        self, samples: list[Sample], joint_actions: list[JointAction], table: list[tuple]
    ) -> list[dict[str, float]]:
        """The logs' per-turn figures over every process's joint actions (`table`); no advantage yet. The share of
        groups whose rewards are all equal is over the prompt groups at turn 0, and NaN after it (one trajectory per
        node: no group)."""
        turn_stats = []
        for turn in range(self.num_turns):
            rows = [entry for entry in table if entry[0] == turn]
            if not rows:
                break
            rewards = torch.tensor([entry[3] for entry in rows], dtype=torch.float32)
            returns = torch.tensor([entry[4] for entry in rows], dtype=torch.float32)
            zero_std = math.nan
            if turn == 0:
                groups = defaultdict(list)
                for entry in rows:
                    groups[entry[1]].append(entry[3])
                zero_std = sum(len(set(group)) == 1 for group in groups.values()) / len(groups)
            turn_stats.append(
                {
                    "reward": torch.nanmean(rewards).item(),
                    "return": torch.nanmean(returns).item(),
                    "frac_reward_zero_std": zero_std,
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


def critic_inputs(rollout: Rollout, kind: str, agent_names: list[str]) -> list[list[Prompt]]:
    """What each critic reads at each joint action, before its action: `[j][c]`, the input of critic `c` at joint
    action `j`.

    IAC (`kind="iac"`): agent `c`'s critic reads what agent `c` was given (its sample's `model_input`: its role and
    observation), as CoMLRL's critic reads its agent's prompt. MAAC (`"maac"`): the one critic reads every agent's
    input of the turn, each under its name (CoMLRL: `[Agent i] prompt`, joined by blank lines), as text (a chat
    input's messages as `role: content` lines). Raises ValueError where an agent did not act at a joint action."""
    inputs: dict[tuple, dict[int, Prompt]] = {}
    for sample in rollout.samples:
        inputs.setdefault((sample.node, sample.position), {})[sample.agent] = sample.model_input
    rows = []
    for joint_action in rollout.joint_actions:
        given = inputs.get((joint_action.node, joint_action.index), {})
        missing = [name for agent, name in enumerate(agent_names) if agent not in given]
        if missing:
            raise ValueError(
                f"At turn {joint_action.turn} agent(s) {missing} did not act: a critic needs every agent's input at "
                "every turn (a scheduler that lets every agent act)."
            )
        if kind == "iac":
            rows.append([given[agent] for agent in range(len(agent_names))])
        else:
            joint = "\n\n".join(f"[{name}] {as_text(given[agent])}" for agent, name in enumerate(agent_names))
            rows.append([joint])
    return rows


def as_text(prompt: Prompt) -> str:
    """A prompt as text: a string as it is, chat messages as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{message['role']}: {message.get('content') or ''}" for message in prompt)


def critic_advantages(
    rollout: Rollout,
    values: torch.Tensor,
    discount: float,
    gae_lambda: float,
    normalize: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Set every sample's and joint action's advantage from a critic's values, by GAE along each trajectory, and
    return the critic's targets.

    A joint action no reward function could score (team reward NaN) counts as a reward of 0 for the turns before it,
    and gives its own samples advantage 0 and no critic target (NaN), as an unscorable joint action gives no gradient
    in MAGRPO. A task with a sparse reward says 0 at the turns without one, not NaN.

    Args:
        rollout: a `TrajectoryRollout`'s (this process's joint actions and samples).
        values: `(J, C)` the critic's value of each joint action's history, before its action, per critic: `C` is the
            number of agents for critics of their own (IAC: column `i` is agent `i`'s critic), 1 for one critic of
            the team (MAAC: every agent's samples take its advantage). Taken as constants (detached).
        discount: γ.
        gae_lambda: λ.
        normalize: applied to the `(J', C)` advantages of this process's scored joint actions before they reach the
            samples (e.g. a z-score; with several processes, its statistics are this process's unless it gathers
            them); None keeps them.

    Returns:
        `(J, C)` the λ-returns, each joint action's critic target (NaN: none). A joint action's `advantage` (for the
        logs) is the mean over its critics of theirs.
    """
    joint_actions = rollout.joint_actions
    if values.dim() != 2 or values.shape[0] != len(joint_actions):
        raise ValueError(f"`values` has shape {tuple(values.shape)}: one row per joint action ({len(joint_actions)}).")
    agents = 1 + max((sample.agent for sample in rollout.samples), default=0)
    critics = values.shape[1]
    if critics != 1 and critics < agents:
        raise ValueError(f"`values` has {critics} columns: one per agent ({agents} or more), or 1 for the team.")
    if not joint_actions:
        return values.new_zeros(0, critics)
    values = values.detach()
    chains = trajectories(joint_actions)
    turns = max(len(chain) for chain in chains)
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
    unscored = torch.tensor([ja.reward != ja.reward for ja in joint_actions])
    if normalize is not None:
        advantages[~unscored] = normalize(advantages[~unscored])
    advantages[unscored], returns[unscored] = 0.0, math.nan
    at = {(ja.node, ja.index): j for j, ja in enumerate(joint_actions)}
    for j, joint_action in enumerate(joint_actions):
        joint_action.advantage = advantages[j].mean().item()
    for sample in rollout.samples:
        j = at[(sample.node, sample.position)]
        sample.advantage = advantages[j, sample.agent if critics > 1 else 0].item()
    return returns
