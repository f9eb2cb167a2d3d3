"""MAGRPO's advantage math as pure functions on tensors (docs/design.md, §5).

Shapes: `num_groups` prompt groups (tree nodes), `G` completions per agent, `N` agents, `K` joint actions per group
(`G` aligned, `G**N` cross). A group's joint actions are laid out in row-major order of the agents' completion
indices: joint action `k` of a cross group takes completion `g_i` from agent `i`, where
`(g_0, ..., g_{N-1}) = unravel_index(k, (G,) * N)`.
"""

import torch
from trl.trainer.utils import nanstd

ADVANTAGE_EPS = 1e-4  # as TRL's GRPOTrainer


def team_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted team reward of each joint action: `r = Σ_k w_k · R_k`.

    Args:
        rewards_per_func: `(J, F)` rewards of F reward functions for J joint actions; NaN where a function returned
            None (did not apply).
        weights: `(F,)` reward weights.

    Returns:
        `(J,)` rewards; NaN where every function returned None (the joint action is unscorable).
    """
    rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards


def baseline_values(rewards: torch.Tensor, baseline: str) -> torch.Tensor:
    """Per-member baseline `b` of `(num_groups, K)` rewards, NaN-aware (NaN members are ignored).

    - `mean`: `b = mean_j r_j` (MAGRPO / GRPO);
    - `rloo`: `b_k = mean_{j≠k} r_j` (leave-one-out);
    - `max`: `b = max_j r_j`;
    - `none`: `b = 0`.
    """
    if baseline == "mean":
        return torch.nanmean(rewards, dim=1, keepdim=True).expand_as(rewards)
    if baseline == "rloo":
        valid = ~torch.isnan(rewards)
        total = rewards.nansum(dim=1, keepdim=True)
        others = valid.sum(dim=1, keepdim=True) - valid.long()
        leave_one_out = (total - torch.nan_to_num(rewards, nan=0.0)) / others.clamp(min=1)
        # A lone scorable member has nothing to be compared with: it is its own baseline (advantage 0).
        return torch.where(others > 0, leave_one_out, rewards)
    if baseline == "max":
        filled = torch.nan_to_num(rewards, nan=-torch.inf)
        return filled.max(dim=1, keepdim=True).values.expand_as(rewards)
    if baseline == "none":
        return torch.zeros_like(rewards)
    raise ValueError(f"Unknown baseline {baseline!r}; expected 'mean', 'rloo', 'max' or 'none'.")


def group_advantages(
    rewards: torch.Tensor, baseline: str = "mean", scale_rewards: str = "group", batch_std: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of the joint actions of each group: `A = (r − b) / (σ + 1e-4)`.

    Args:
        rewards: `(num_groups, K)` team rewards, NaN for unscorable joint actions.
        baseline: see [`baseline_values`].
        scale_rewards: `"group"` (σ = std within the group), `"batch"` (σ = std of every reward of the batch) or
            `"none"` (no division), as TRL's `scale_rewards`.
        batch_std: σ for `"batch"` when the batch holds more than `rewards` (a MAGRPO tree's other turns); by
            default the std of `rewards`.

    Returns:
        `(advantages, group_std)`, both `(num_groups, K)`. Unscorable members get advantage 0. `group_std` is each
        group's own std whatever the scaling: the zero-std metric counts groups that carry no signal.
    """
    if rewards.size(1) > 1:
        group_std = nanstd(rewards, dim=1).unsqueeze(1).expand_as(rewards)
    else:
        group_std = torch.zeros_like(rewards)
    if scale_rewards in ("group", "none"):
        std = group_std
    elif scale_rewards == "batch":
        if batch_std is None:
            batch_std = nanstd(rewards) if rewards.numel() > 1 else torch.zeros(())
        std = torch.as_tensor(batch_std, dtype=rewards.dtype).expand_as(rewards)
    else:
        raise ValueError(f"Unknown scale_rewards {scale_rewards!r}; expected 'group', 'batch' or 'none'.")
    advantages = rewards - baseline_values(rewards, baseline)
    if scale_rewards != "none":
        advantages = advantages / (std + ADVANTAGE_EPS)
    return torch.nan_to_num(advantages, nan=0.0), group_std


def aligned_credit(advantages: torch.Tensor, num_agents: int) -> torch.Tensor:
    """Aligned joint actions: every agent's g-th completion gets `A(g)`.

    `(num_groups, G)` → `(num_groups, G, N)`.
    """
    return advantages.unsqueeze(-1).expand(*advantages.shape, num_agents)


def cross_credit(advantages: torch.Tensor, num_agents: int, num_generations: int) -> torch.Tensor:
    """Cross joint actions: agent i's completion g gets the *mean* advantage of the joint actions it took part in,
    `A_i(g) = mean_{k: g_i(k) = g} A(k)` (the reference code sums; the mean keeps the scale independent of N).

    `(num_groups, G**N)` → `(num_groups, G, N)`.
    """
    num_groups = advantages.size(0)
    grid = advantages.reshape(num_groups, *([num_generations] * num_agents))
    per_agent = []
    for agent in range(num_agents):
        other_axes = [1 + axis for axis in range(num_agents) if axis != agent]
        per_agent.append(grid.mean(dim=other_axes) if other_axes else grid)
    return torch.stack(per_agent, dim=-1)


def cross_joint_indices(num_agents: int, num_generations: int) -> torch.Tensor:
    """`(G**N, N)` completion index of each agent in each cross joint action, in the layout above."""
    axes = [torch.arange(num_generations)] * num_agents
    return torch.cartesian_prod(*axes).reshape(-1, num_agents)


def tree_returns(rewards: torch.Tensor, parents: torch.Tensor, discount: float) -> torch.Tensor:
    """Monte-Carlo returns over a tree of joint actions: a leaf's `R = r`; an inner joint action's
    `R(j) = r(j) + γ · mean(R(c) for c in children(j))`.

    Args:
        rewards: `(J,)` team rewards; NaN for an unscorable joint action (its return is NaN: it gets advantage 0).
        parents: `(J,)` index of the joint action whose child node holds `j`, or -1 at the root. Parents come before
            their children (`parents[j] < j`).
        discount: γ.

    Returns:
        `(J,)` returns. Children with a NaN return are left out of the mean.
    """
    rewards, parents = rewards.tolist(), parents.tolist()
    child_sum, child_count = [0.0] * len(rewards), [0] * len(rewards)
    returns = list(rewards)
    for j in reversed(range(len(rewards))):
        if child_count[j]:
            returns[j] = rewards[j] + discount * child_sum[j] / child_count[j]
        parent = parents[j]
        if parent >= 0 and returns[j] == returns[j]:  # NaN != NaN
            if parent >= j:
                raise ValueError(f"Joint action {j} has parent {parent}: parents must come before their children.")
            child_sum[parent] += returns[j]
            child_count[parent] += 1
    return torch.tensor(returns, dtype=torch.float32)


def node_credit(
    returns: torch.Tensor,
    joint_mode: str,
    num_agents: int,
    num_generations: int,
    baseline: str,
    scale_rewards: str,
    batch_std: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advantages of the sibling joint actions of each node, and each agent's credit.

    Args:
        returns: `(num_nodes, K)` returns of each node's joint actions, in the layout of this module's docstring.
        batch_std: σ of `scale_rewards="batch"`, see [`group_advantages`].

    Returns:
        `(credit, advantages, std)`: `credit` is `(num_nodes, G, N)`, the advantage of agent `i`'s completion `g`;
        `advantages` and `std` (each node's own std) are `(num_nodes, K)` as [`group_advantages`].
    """
    advantages, std = group_advantages(returns, baseline, scale_rewards, batch_std)
    if joint_mode == "aligned":
        credit = aligned_credit(advantages, num_agents)
    else:
        credit = cross_credit(advantages, num_agents, num_generations)
    return credit, advantages, std


def generalized_advantages(
    rewards: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, discount: float, gae_lambda: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-turn advantages of trajectories from a critic's values, by generalized advantage estimation (GAE):
    `δ_t = r_t + γ·V_{t+1} − V_t` (no `V_{t+1}` after a trajectory's last turn: it ended), `A_t = Σ_l (γλ)^l δ_{t+l}`,
    and the critic's targets, the λ-returns `A_t + V_t`.

    With λ = 1 the advantage is the discounted reward-to-go minus `V_t`; with λ = 0 it is the one-step TD error
    `δ_t`. With a critic that answers 0 and γ = λ = 1 it is the reward-to-go `Σ_{k≥t} r_k`, MAGRPO's return with
    `baseline="none"`.

    Args:
        rewards: `(B, T)` team reward of each turn, 0 where a turn gave none (a sparse reward at the end); turns at and
            past a trajectory's length are ignored.
        values: `(B, T)` the critic's value of each turn's history, taken before the turn's action.
        lengths: `(B,)` turns each trajectory played, 1..T (an episode that ended early is shorter).
        discount: γ.
        gae_lambda: λ.

    Returns:
        `(advantages, returns)`, both `(B, T)`, 0 past each trajectory's length.
    """
    batch, turns = rewards.shape
    played = torch.arange(turns, device=rewards.device).unsqueeze(0) < lengths.unsqueeze(1)
    rewards = torch.where(played, rewards, torch.zeros_like(rewards))
    values = torch.where(played, values, torch.zeros_like(values))
    next_values = torch.cat([values[:, 1:], values.new_zeros(batch, 1)], dim=1)  # 0 after the last turn played
    deltas = rewards + discount * next_values - values
    advantages = torch.zeros_like(rewards)
    running = rewards.new_zeros(batch)
    for turn in reversed(range(turns)):
        running = deltas[:, turn] + discount * gae_lambda * running
        advantages[:, turn] = running  # past a trajectory's length every δ is 0: so is its advantage
    return advantages, advantages + values
