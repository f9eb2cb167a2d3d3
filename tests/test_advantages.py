"""Specification of MAGRPO's advantage math (trl_marl.rollouts.advantages, docs/design.md §5), on hand-computed
examples.

Every expected value is a literal worked out by hand in the comment above it; `EPS` is TRL's 1e-4 in the
denominator of scaled advantages. Sample standard deviations use Bessel's correction (divide by n - 1).
"""

import math

import pytest
import torch
from trl.trainer.utils import nanstd

from trl_marl.rollouts.advantages import (
    aligned_credit,
    baseline_values,
    cross_credit,
    cross_joint_indices,
    generalized_advantages,
    group_advantages,
    team_rewards,
)

nan = float("nan")
EPS = 1e-4


def assert_close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-6, atol=1e-6)


# team_rewards


def test_team_reward_is_weighted_sum_of_reward_functions():
    rewards_per_func = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
    weights = torch.tensor([1.0, 0.5])
    # 1*1 + 0.5*2 = 2;  1*3 + 0.5*(-4) = 1
    assert_close(team_rewards(rewards_per_func, weights), [2.0, 1.0])


def test_team_reward_ignores_a_function_that_returned_none():
    rewards_per_func = torch.tensor([[3.0, nan], [nan, 4.0]])
    weights = torch.tensor([1.0, 0.5])
    # row 0: only function 0 applies -> 1*3 = 3;  row 1: only function 1 -> 0.5*4 = 2
    assert_close(team_rewards(rewards_per_func, weights), [3.0, 2.0])


def test_team_reward_is_nan_when_every_function_returned_none():
    rewards_per_func = torch.tensor([[1.0, 2.0], [nan, nan]])
    weights = torch.tensor([1.0, 1.0])
    rewards = team_rewards(rewards_per_func, weights)
    assert rewards[0].item() == 3.0  # 1 + 2
    assert math.isnan(rewards[1].item())


# baseline_values


def test_mean_baseline_is_group_mean():
    # (1 + 2 + 3 + 6) / 4 = 3;  (0 + 4 + 4 + 8) / 4 = 4
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.0, 4.0, 4.0, 8.0]])
    assert_close(baseline_values(rewards, "mean"), [[3.0] * 4, [4.0] * 4])


def test_rloo_baseline_is_mean_of_the_other_members():
    # total 12: (12-1)/3, (12-2)/3, (12-3)/3, (12-6)/3
    assert_close(baseline_values(torch.tensor([[1.0, 2.0, 3.0, 6.0]]), "rloo"), [[11 / 3, 10 / 3, 3.0, 2.0]])


def test_max_baseline_is_group_max():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0], [5.0, -1.0, 0.0, 2.0]])
    assert_close(baseline_values(rewards, "max"), [[6.0] * 4, [5.0] * 4])


def test_none_baseline_is_zero():
    assert_close(baseline_values(torch.tensor([[1.0, 2.0, 3.0, 6.0]]), "none"), [[0.0] * 4])


def test_baselines_ignore_nan_members():
    rewards = torch.tensor([[2.0, nan, 4.0, 6.0]])
    valid = [0, 2, 3]
    # valid members 2, 4, 6: mean = 4; max = 6; rloo = (12-2)/2, (12-4)/2, (12-6)/2 = 5, 4, 3
    assert_close(baseline_values(rewards, "mean")[0, valid], [4.0, 4.0, 4.0])
    assert_close(baseline_values(rewards, "max")[0, valid], [6.0, 6.0, 6.0])
    assert_close(baseline_values(rewards, "rloo")[0, valid], [5.0, 4.0, 3.0])


def test_unknown_baseline_raises_with_allowed_values():
    with pytest.raises(ValueError, match="'median'.*'mean', 'rloo', 'max' or 'none'"):
        baseline_values(torch.zeros(1, 2), "median")


# group_advantages, scale_rewards="none": exact r - b

REWARDS_1236 = torch.tensor([[1.0, 2.0, 3.0, 6.0]])  # mean 3


def test_mean_baseline_unscaled_advantages():
    advantages, _ = group_advantages(REWARDS_1236, "mean", "none")
    # r - 3
    assert_close(advantages, [[-2.0, -1.0, 0.0, 3.0]])


def test_rloo_baseline_unscaled_advantages():
    advantages, _ = group_advantages(REWARDS_1236, "rloo", "none")
    # r - (12 - r)/3: 1-11/3, 2-10/3, 3-3, 6-2
    assert_close(advantages, [[-8 / 3, -4 / 3, 0.0, 4.0]])


def test_max_baseline_unscaled_advantages():
    advantages, _ = group_advantages(REWARDS_1236, "max", "none")
    # r - 6
    assert_close(advantages, [[-5.0, -4.0, -3.0, 0.0]])


def test_no_baseline_unscaled_advantages_are_the_rewards():
    advantages, _ = group_advantages(REWARDS_1236, "none", "none")
    assert_close(advantages, [[1.0, 2.0, 3.0, 6.0]])


def test_unscaled_advantages_still_report_group_std():
    _, std = group_advantages(torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]]), "mean", "none")
    # group 0: deviations -1,0,1 -> (1+0+1)/2 = 1 -> std 1;  group 1: -2,0,2 -> (4+0+4)/2 = 4 -> std 2
    assert_close(std, [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])


# group_advantages, scale_rewards="group": (r - b) / (group std + EPS)

REWARDS_GROUPS = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]])  # group std 1 and 2, means 2 and 4


def test_mean_baseline_group_scaled_advantages():
    advantages, std = group_advantages(REWARDS_GROUPS, "mean", "group")
    # group 0: (r - 2) / (1 + EPS);  group 1: (r - 4) / (2 + EPS)
    assert_close(advantages, [[-1 / 1.0001, 0.0, 1 / 1.0001], [-2 / 2.0001, 0.0, 2 / 2.0001]])
    assert_close(std, [[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])


def test_rloo_baseline_group_scaled_advantages():
    advantages, _ = group_advantages(REWARDS_GROUPS, "rloo", "group")
    # group 0: b = (6-1)/2, (6-2)/2, (6-3)/2 = 2.5, 2, 1.5 -> r - b = -1.5, 0, 1.5; / (1 + EPS)
    # group 1: b = (12-2)/2, (12-4)/2, (12-6)/2 = 5, 4, 3 -> r - b = -3, 0, 3; / (2 + EPS)
    assert_close(advantages, [[-1.5 / 1.0001, 0.0, 1.5 / 1.0001], [-3 / 2.0001, 0.0, 3 / 2.0001]])


def test_max_baseline_group_scaled_advantages():
    advantages, _ = group_advantages(REWARDS_GROUPS, "max", "group")
    # group 0: r - 3 = -2, -1, 0; / (1 + EPS);  group 1: r - 6 = -4, -2, 0; / (2 + EPS)
    assert_close(advantages, [[-2 / 1.0001, -1 / 1.0001, 0.0], [-4 / 2.0001, -2 / 2.0001, 0.0]])


def test_no_baseline_group_scaled_advantages():
    advantages, _ = group_advantages(REWARDS_GROUPS, "none", "group")
    # r / (std + EPS)
    assert_close(advantages, [[1 / 1.0001, 2 / 1.0001, 3 / 1.0001], [2 / 2.0001, 4 / 2.0001, 6 / 2.0001]])


def test_group_with_equal_rewards_gets_zero_advantage():
    advantages, std = group_advantages(torch.tensor([[5.0, 5.0, 5.0]]), "mean", "group")
    # (5 - 5) / (0 + EPS) = 0
    assert_close(advantages, [[0.0, 0.0, 0.0]])
    assert_close(std, [[0.0, 0.0, 0.0]])


def test_group_scaling_equals_trl_grpo_advantages():
    torch.manual_seed(0)
    num_generations = 6
    flat_rewards = torch.rand(4 * num_generations) * 10 - 3
    # TRL's GRPOTrainer._generate_and_score_completions, scale_rewards="group":
    mean_grouped = torch.nanmean(flat_rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    std_grouped = nanstd(flat_rewards.view(-1, num_generations), dim=1).repeat_interleave(num_generations)
    trl_advantages = (flat_rewards - mean_grouped) / (std_grouped + 1e-4)

    advantages, std = group_advantages(flat_rewards.view(-1, num_generations), "mean", "group")

    assert torch.equal(advantages.flatten(), trl_advantages)
    assert torch.equal(std.flatten(), std_grouped)


# group_advantages, scale_rewards="batch": (r - b) / (std of all rewards + EPS)


def test_batch_scaling_divides_by_std_of_all_rewards():
    rewards = torch.tensor([[4.0, 0.0], [0.0, 0.0]])
    advantages, std = group_advantages(rewards, "mean", "batch")
    # all rewards: mean 1, deviations 3,-1,-1,-1 -> (9+1+1+1)/3 = 4 -> batch std 2
    # (group 0 alone would have std sqrt(8)): group means 2 and 0 -> r - b = 2, -2, 0, 0; / (2 + EPS)
    assert_close(advantages, [[2 / 2.0001, -2 / 2.0001], [0.0, 0.0]])
    # the std returned is each group's own (for the zero-std metric: group 1 carries no signal), not the batch's
    assert_close(std, [[8**0.5, 8**0.5], [0.0, 0.0]])


def test_batch_scaling_divides_by_a_given_batch_std():
    rewards = torch.tensor([[4.0, 0.0]])
    advantages, std = group_advantages(rewards, "mean", "batch", batch_std=torch.tensor(4.0))
    assert_close(advantages, [[2 / 4.0001, -2 / 4.0001]])
    assert_close(std, [[8**0.5, 8**0.5]])


def test_unknown_scale_rewards_raises_with_allowed_values():
    with pytest.raises(ValueError, match="'global'.*'group', 'batch' or 'none'"):
        group_advantages(torch.zeros(1, 2), "mean", "global")


# group_advantages with unscorable (NaN) joint actions


def test_nan_member_is_ignored_by_mean_baseline_and_std_and_gets_zero_advantage():
    advantages, _ = group_advantages(torch.tensor([[2.0, nan, 4.0, 6.0]]), "mean", "group")
    # valid 2, 4, 6: mean 4, deviations -2,0,2 -> (4+0+4)/2 = 4 -> std 2; (r - 4) / (2 + EPS); NaN -> 0
    assert_close(advantages, [[-2 / 2.0001, 0.0, 0.0, 2 / 2.0001]])


def test_nan_member_is_ignored_by_rloo_baseline_and_gets_zero_advantage():
    advantages, _ = group_advantages(torch.tensor([[2.0, nan, 4.0, 6.0]]), "rloo", "none")
    # b = (12-2)/2, -, (12-4)/2, (12-6)/2 = 5, -, 4, 3 -> r - b = -3, 0, 0, 3
    assert_close(advantages, [[-3.0, 0.0, 0.0, 3.0]])


def test_rloo_lone_scorable_member_gets_zero_advantage():
    # no other scorable member to leave one out from: no learning signal, as with the mean baseline (5 - 5 = 0)
    advantages, _ = group_advantages(torch.tensor([[5.0, nan]]), "rloo", "none")
    assert_close(advantages, [[0.0, 0.0]])


def test_nan_member_is_ignored_by_max_baseline_and_gets_zero_advantage():
    advantages, _ = group_advantages(torch.tensor([[2.0, nan, 4.0, 6.0]]), "max", "none")
    # b = 6 -> -4, 0, -2, 0
    assert_close(advantages, [[-4.0, 0.0, -2.0, 0.0]])


def test_fully_unscorable_group_gets_zero_advantages():
    advantages, _ = group_advantages(torch.tensor([[nan, nan], [1.0, 3.0]]), "mean", "group")
    # group 1: mean 2, deviations -1,1 -> 2/1 = 2 -> std sqrt(2)
    assert_close(advantages, [[0.0, 0.0], [-1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)]])


# credit assignment


def test_aligned_credit_gives_every_agent_the_advantage_of_its_joint_action():
    advantages = torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, -2.0]])
    credit = aligned_credit(advantages, num_agents=2)
    # (num_groups, G, N): agent i's g-th completion gets A(g)
    assert_close(credit, [[[1.0, 1.0], [-1.0, -1.0], [0.5, 0.5]], [[2.0, 2.0], [0.0, 0.0], [-2.0, -2.0]]])


def test_cross_credit_two_agents_is_mean_over_joint_actions_the_completion_took_part_in():
    # joint action k = g0*2 + g1: k0=(0,0) k1=(0,1) k2=(1,0) k3=(1,1)
    advantages = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.0, 4.0, 0.0, 8.0]])
    credit = cross_credit(advantages, num_agents=2, num_generations=2)
    # group 0: agent 0: g=0 -> (k0+k1)/2 = 1.5, g=1 -> (k2+k3)/2 = 4.5
    #          agent 1: g=0 -> (k0+k2)/2 = 2,   g=1 -> (k1+k3)/2 = 4
    # group 1: agent 0: (0+4)/2 = 2, (0+8)/2 = 4;  agent 1: (0+0)/2 = 0, (4+8)/2 = 6
    # layout (num_groups, G, N): credit[group, g, agent]
    assert_close(credit, [[[1.5, 2.0], [4.5, 4.0]], [[2.0, 0.0], [4.0, 6.0]]])


def test_cross_credit_three_agents_is_mean_not_sum():
    # joint action k = g0*4 + g1*2 + g2, with A(k) = k
    advantages = torch.arange(8, dtype=torch.float32).unsqueeze(0)
    credit = cross_credit(advantages, num_agents=3, num_generations=2)
    # agent 0: g=0 -> k in {0,1,2,3} mean 1.5;  g=1 -> {4,5,6,7} mean 5.5
    # agent 1: g=0 -> k in {0,1,4,5} mean 2.5;  g=1 -> {2,3,6,7} mean 4.5
    # agent 2: g=0 -> k in {0,2,4,6} mean 3;    g=1 -> {1,3,5,7} mean 4
    assert_close(credit, [[[1.5, 2.5, 3.0], [5.5, 4.5, 4.0]]])


def test_cross_joint_indices_are_row_major_product():
    assert cross_joint_indices(2, 3).tolist() == [
        [0, 0],
        [0, 1],
        [0, 2],
        [1, 0],
        [1, 1],
        [1, 2],
        [2, 0],
        [2, 1],
        [2, 2],
    ]


def test_cross_joint_indices_match_cross_credit_layout():
    # three agents, G=2: joint action 5 = 1*4 + 0*2 + 1 is (1, 0, 1)
    indices = cross_joint_indices(3, 2)
    assert indices.shape == (8, 3)
    assert indices[5].tolist() == [1, 0, 1]


def test_cross_joint_indices_single_agent_is_a_column():
    assert cross_joint_indices(1, 3).tolist() == [[0], [1], [2]]


# -- generalized advantage estimation (actor-critic trainers)


def test_gae_by_hand_on_a_two_turn_and_a_one_turn_trajectory():
    """γ = 0.9, λ = 0.5. Trajectory 0 plays 2 turns: δ_1 = 1 − 0.4 = 0.6, δ_0 = 0 + 0.9·0.4 − 0.2 = 0.16,
    A_0 = 0.16 + 0.45·0.6 = 0.43. Trajectory 1 ended after its first turn: δ_0 = 2 − 0.5 (no bootstrap), and its
    second turn (values and rewards there are garbage) is ignored."""
    rewards = torch.tensor([[0.0, 1.0], [2.0, 7.0]])
    values = torch.tensor([[0.2, 0.4], [0.5, 9.0]])
    advantages, returns = generalized_advantages(rewards, values, torch.tensor([2, 1]), 0.9, 0.5)
    torch.testing.assert_close(advantages, torch.tensor([[0.43, 0.6], [1.5, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.63, 1.0], [2.0, 0.0]]))


def test_gae_with_a_zero_critic_and_gamma_lambda_one_is_the_reward_to_go():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.5, 0.0, 2.0, 0.0]])
    advantages, returns = generalized_advantages(rewards, torch.zeros(2, 4), torch.tensor([4, 3]), 1.0, 1.0)
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 1.0, 1.0, 1.0], [2.5, 2.0, 2.0, 0.0]]))
    torch.testing.assert_close(returns, advantages)


def test_gae_lambda_zero_is_the_td_error_and_lambda_one_the_discounted_return_minus_the_value():
    rewards, values, lengths = torch.tensor([[1.0, 0.0, 3.0]]), torch.tensor([[0.5, 1.5, 2.0]]), torch.tensor([3])
    td, _ = generalized_advantages(rewards, values, lengths, 0.5, 0.0)
    torch.testing.assert_close(td, torch.tensor([[1.0 + 0.75 - 0.5, 0.0 + 1.0 - 1.5, 3.0 - 2.0]]))
    monte_carlo, returns = generalized_advantages(rewards, values, lengths, 0.5, 1.0)
    discounted = torch.tensor([[1.0 + 0.25 * 3.0, 0.5 * 3.0, 3.0]])
    torch.testing.assert_close(monte_carlo, discounted - values)
    torch.testing.assert_close(returns, discounted)
