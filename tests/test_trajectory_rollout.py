"""Episodes for a critic without a model (`rollouts.trajectory_rollout`): one continuation per joint action, the
chains followed, and GAE advantages and critic targets from given values against hand computations; a critic held
at zero with γ = λ = 1 gives MAGRPO's single-turn advantages with `baseline="none"`."""

import pytest
import torch
from test_rollout import AGENTS, ScriptedTeam, approx

from trl_marl.rollouts.magrpo_rollout import TreeRollout
from trl_marl.rollouts.rollout import NextTurn, RolloutSettings, default_transition
from trl_marl.rollouts.trajectory_rollout import TrajectoryRollout, critic_advantages, trajectories


def settings(num_turns, **overrides):
    values = dict(
        agent_names=AGENTS,
        num_turns=num_turns,
        termination_threshold=None,
        reward_weights=torch.tensor([1.0]),
        baseline="none",
        scale_rewards="none",
        transition=default_transition,
        agent_input=lambda agent, prompt: f"<{AGENTS[agent]}> {prompt}",
    )
    return RolloutSettings(**{**values, **overrides})


def play(script, num_turns=3, num_generations=2, **overrides):
    team = ScriptedTeam(script)
    rollout = TrajectoryRollout(settings(num_turns, **overrides), num_generations, discount=1.0)
    played = rollout.run([{"prompt": "task"}] * num_generations, 0, team.generate, team.score)
    assert not team.script, "fewer completions than the script holds"
    return played


def test_each_copy_of_a_prompt_is_one_trajectory_of_every_turn_and_a_turn_samples_g_times_n():
    # (a, b) per turn, rewards a + b. Copy 0: (1,0) (0,0) (1,1) -> 1, 0, 2; copy 1: (0,0) (1,0) (0,1) -> 0, 1, 1
    rollout = play([1, 0, 0, 0] + [0, 0, 1, 0] + [1, 1, 0, 1])
    assert len(rollout.samples) == 3 * 2 * 2  # T turns x G copies x N agents, not the tree's (1 + G + G^2) x G x N
    chains = trajectories(rollout.joint_actions)
    assert [[rollout.joint_actions[j].reward for j in chain] for chain in chains] == [[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]]
    assert [[rollout.joint_actions[j].turn for j in chain] for chain in chains] == [[0, 1, 2], [0, 1, 2]]
    assert all(sample.advantage == 0.0 for sample in rollout.samples)  # until the critic's values come


def test_gae_advantages_and_targets_of_given_values_match_hand_computation_per_agent_critic():
    rollout = play([1, 0, 0, 0] + [0, 0, 1, 0] + [1, 1, 0, 1], num_turns=3)
    chains = trajectories(rollout.joint_actions)
    values = torch.zeros(len(rollout.joint_actions), 2)  # IAC: a critic per agent
    for row, chain in enumerate(chains):
        for turn, j in enumerate(chain):
            values[j] = torch.tensor([0.5 * turn + row, -1.0])  # agent a's critic varies, b's says -1 everywhere
    gamma, lam = 0.9, 0.8
    returns = critic_advantages(rollout, values, gamma, lam)

    def gae(rewards, v):
        deltas = [rewards[t] + gamma * (v[t + 1] if t + 1 < len(v) else 0.0) - v[t] for t in range(len(v))]
        out, running = [0.0] * len(v), 0.0
        for t in reversed(range(len(v))):
            running = deltas[t] + gamma * lam * running
            out[t] = running
        return out

    for row, (chain, rewards) in enumerate(zip(chains, ([1, 0, 2], [0, 1, 1]))):
        for column, v in enumerate(([0.0 + row, 0.5 + row, 1.0 + row], [-1.0, -1.0, -1.0])):
            expected = gae(rewards, v)
            assert [returns[j, column].item() for j in chain] == approx([a + b for a, b in zip(expected, v)])
            for turn, j in enumerate(chain):
                joint_action = rollout.joint_actions[j]
                sample = next(
                    s
                    for s in rollout.samples
                    if (s.node, s.position, s.agent) == (joint_action.node, joint_action.index, column)
                )
                assert sample.advantage == approx(expected[turn])


def test_one_critic_for_the_team_gives_every_agent_the_same_advantage_written_out():
    # copy 0: rewards 1, 0; copy 1: 0, 1. V = 0.25 everywhere, gamma 0.5, lambda 0.5:
    # copy 0: d1 = 0 - 0.25 = -0.25, d0 = 1 + 0.5 * 0.25 - 0.25 = 0.875; A1 = -0.25, A0 = 0.875 + 0.25 * -0.25 = 0.8125
    # copy 1: d1 = 1 - 0.25 = 0.75, d0 = 0 + 0.125 - 0.25 = -0.125; A1 = 0.75, A0 = -0.125 + 0.25 * 0.75 = 0.0625
    rollout = play([1, 0, 0, 0] + [0, 0, 1, 0], num_turns=2)
    values = torch.tensor([[0.25]] * len(rollout.joint_actions))  # MAAC: one column
    returns = critic_advantages(rollout, values, 0.5, 0.5)
    chains = trajectories(rollout.joint_actions)
    expected = {chains[0][0]: 0.8125, chains[0][1]: -0.25, chains[1][0]: 0.0625, chains[1][1]: 0.75}
    for j, joint_action in enumerate(rollout.joint_actions):
        pair = [
            s.advantage for s in rollout.samples if (s.node, s.position) == (joint_action.node, joint_action.index)
        ]
        assert pair == approx([expected[j]] * 2) and joint_action.advantage == approx(expected[j])
        assert returns[j, 0].item() == approx(expected[j] + 0.25)


def test_early_termination_ends_a_trajectory_on_its_own_reward_not_its_prompt_groups_mean():
    # turn 0: copy 0 (1, 1) -> 2 reaches the threshold 2 and ends; copy 1 (0, 0) -> 0 goes on (the mean, 1, would not)
    rollout = play([1, 1, 0, 0] + [1, 0], num_turns=2, termination_threshold=2.0)
    assert [len(chain) for chain in trajectories(rollout.joint_actions)] == [1, 2]
    assert [ja.terminated for ja in rollout.joint_actions] == [True, False, False]


def test_an_unscorable_joint_action_gives_its_samples_no_advantage_and_its_critic_no_target():
    class UnscorableAtTurnOne(ScriptedTeam):
        @staticmethod
        def score(joint_actions):
            return torch.tensor([[float("nan") if ja.turn == 1 else 1.0] for ja in joint_actions])

    team = UnscorableAtTurnOne([0] * 12)
    rollout = TrajectoryRollout(settings(3), 2).run([{"prompt": "task"}] * 2, 0, team.generate, team.score)
    returns = critic_advantages(rollout, torch.zeros(len(rollout.joint_actions), 1), 1.0, 1.0)
    for j, joint_action in enumerate(rollout.joint_actions):
        samples = [s for s in rollout.samples if (s.node, s.position) == (joint_action.node, joint_action.index)]
        if joint_action.turn == 1:
            assert all(s.advantage == 0.0 for s in samples) and returns[j, 0].isnan()
        else:  # its NaN counts as 0 in the turns before it: turn 0's reward-to-go is 1 + 0 + 1, turn 2's 1
            assert [s.advantage for s in samples] == [2.0 - joint_action.turn // 2] * 2


def test_a_trajectory_the_transition_ends_early_is_shorter_and_gets_no_value_after_its_end():
    def stop_copy_zero(prompt, observations, joint_action, **kwargs):
        return NextTurn(default_transition(prompt, observations), done=joint_action["a"] == "1")

    rollout = play([1, 0, 0, 0] + [1, 1], num_turns=2, transition=stop_copy_zero)  # copy 0 says a=1: done
    chains = trajectories(rollout.joint_actions)
    assert [len(chain) for chain in chains] == [1, 2]
    values = torch.full((len(rollout.joint_actions), 1), 0.5)
    returns = critic_advantages(rollout, values, 1.0, 1.0)
    short = chains[0][0]
    assert rollout.joint_actions[short].advantage == approx(1.0 - 0.5)  # r - V, no bootstrap after the end
    assert returns[short, 0].item() == approx(1.0)


def test_with_a_critic_at_zero_single_turn_advantages_equal_magrpos_with_no_baseline():
    script = [1, 0, 0, 0, 1, 1, 0, 1]  # 4 copies, (a, b) each
    tree = TreeRollout(settings(1), 4).run(
        [{"prompt": "task"}] * 4, 0, ScriptedTeam(script).generate, ScriptedTeam.score
    )
    rollout = play(list(script), num_turns=1, num_generations=4)
    critic_advantages(rollout, torch.zeros(len(rollout.joint_actions), 2), 1.0, 1.0)
    ours = [(s.node, s.position, s.agent, s.advantage) for s in rollout.samples]
    magrpo = [(s.node, s.position, s.agent, s.advantage) for s in tree.samples]
    assert [a[:3] for a in ours] == [m[:3] for m in magrpo]
    assert torch.allclose(torch.tensor([a[3] for a in ours]), torch.tensor([m[3] for m in magrpo]), atol=1e-6)
    assert [m[3] for m in magrpo] == [1.0, 1.0, 0.0, 0.0, 2.0, 2.0, 1.0, 1.0]  # the team rewards themselves


def test_joint_actions_of_a_tree_are_refused_as_trajectories_naming_the_rollout():
    tree = TreeRollout(settings(2), 2).run(
        [{"prompt": "task"}] * 2, 0, ScriptedTeam([0] * 12).generate, ScriptedTeam.score
    )
    with pytest.raises(ValueError, match="two children.*TrajectoryRollout"):
        trajectories(tree.joint_actions)
    rollout = play([0] * 8, num_turns=2)
    with pytest.raises(ValueError, match=r"`values` has shape \(3, 1\): one row per joint action \(4\)"):
        critic_advantages(rollout, torch.zeros(3, 1), 1.0, 1.0)
    with pytest.raises(ValueError, match="`values` has 0 columns: one per agent"):
        critic_advantages(rollout, torch.zeros(4, 0), 1.0, 1.0)


def test_an_iac_critic_reads_its_own_agents_input_and_a_maac_critic_every_agents_under_their_names():
    from trl_marl.rollouts.trajectory_rollout import critic_inputs

    rollout = play([1, 0, 0, 0] + [0, 0, 1, 0], num_turns=2)
    iac, maac = critic_inputs(rollout, "iac", AGENTS), critic_inputs(rollout, "maac", AGENTS)
    assert len(iac) == len(maac) == len(rollout.joint_actions) == 4
    for j, joint_action in enumerate(rollout.joint_actions):
        given = {
            s.agent: s.model_input
            for s in rollout.samples
            if (s.node, s.position) == (joint_action.node, joint_action.index)
        }
        assert iac[j] == [given[0], given[1]] and given[0].startswith("<a>") and given[1].startswith("<b>")
        assert maac[j] == [f"[a] {given[0]}\n\n[b] {given[1]}"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    from trl_marl.rollouts.trajectory_rollout import as_text

    assert as_text(chat) == "system: Be brief.\nuser: Hi." and as_text("plain") == "plain"
