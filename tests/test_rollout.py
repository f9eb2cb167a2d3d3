"""The MAGRPO tree, without a model: returns, advantages and credit against hand-computed trees; early termination,
`done` and transitions; the padding of rows for TRL's equal micro-batches."""

import math
import statistics

import numpy as np
import pytest
import torch

from trl_marl.rollouts.advantages import tree_returns
from trl_marl.rollouts.magrpo_rollout import TreeRollout
from trl_marl.rollouts.rollout import NextTurn, RolloutSettings, TransitionError, default_transition
from trl_marl.rollouts.rows import pad_rows, row_digest

EPS = 1e-4
AGENTS = ["a", "b"]


def approx(expected, abs=1e-5):
    """Float32 tensors against float64 hand computations."""
    return pytest.approx(expected, rel=1e-5, abs=abs)


def unbiased_std(values):
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def normalized(values):
    """(r − mean) / (std + 1e-4), written out."""
    mean, std = sum(values) / len(values), unbiased_std(values)
    return [(v - mean) / (std + EPS) for v in values]


class ShowsOnlyTheTransition:
    """A scheduler under which an agent sees exactly the prompt the transition gave it."""

    def phases(self, turn, num_agents):
        return [list(range(num_agents))]

    def observe(self, agent, prompt, history, current, names):
        return prompt


class ScriptedTeam:
    """Generation that answers each row with the next number of a script, and a reward that adds the agents'
    numbers: the test knows every completion and every team reward in advance."""

    def __init__(self, script):
        self.script = list(script)
        self.model_inputs = []  # per generate call

    def generate(self, model_inputs, agent_index):
        self.model_inputs.append(list(model_inputs))
        texts = [str(self.script.pop(0)) for _ in model_inputs]
        return [[0]] * len(texts), [[1, 2]] * len(texts), texts

    @staticmethod
    def score(joint_actions):
        return torch.tensor([[float(sum(int(t) for t in ja.completions.values()))] for ja in joint_actions])


def run_tree(script, joint_mode="aligned", num_turns=2, transition=default_transition, examples=None, **overrides):
    team = ScriptedTeam(script)
    settings = dict(
        agent_names=AGENTS,
        num_generations=2,
        num_turns=num_turns,
        joint_mode=joint_mode,
        discount=0.9,
        termination_threshold=None,
        reward_weights=torch.tensor([1.0]),
        baseline="mean",
        scale_rewards="group",
        transition=transition,
        agent_input=lambda agent, prompt: f"<{AGENTS[agent]}> {prompt}",
    )
    settings.update(overrides)
    examples = examples or [{"prompt": "task", "level": 1}] * 2
    tree_keys = ("num_generations", "joint_mode", "discount", "process_index")
    tree = {key: settings.pop(key) for key in tree_keys if key in settings}
    rollout = TreeRollout(RolloutSettings(**settings), **tree)
    rollout = rollout.run(examples, first_copy=0, generate=team.generate, score=team.score)
    assert not team.script, "the tree generated fewer completions than the script holds"
    return rollout, team


def advantages_by(rollout, turn):
    """{(node, position, agent): advantage} of the samples of one turn."""
    return {(s.node, s.position, AGENTS[s.agent]): s.advantage for s in rollout.samples if s.turn == turn}


# ------------------------------------------------------------------ returns


def test_tree_returns_leaf_is_reward_and_inner_node_adds_discounted_mean_of_children():
    # 0 ─┬─ 2 ─┬─ 4
    #    │     └─ 5
    #    └─ 3
    # 1 (leaf)
    rewards = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.0, 3.0])
    parents = torch.tensor([-1, -1, 0, 0, 2, 2])
    returns = tree_returns(rewards, parents, discount=0.5)
    r2 = 2.0 + 0.5 * (1.0 + 3.0) / 2
    r0 = 1.0 + 0.5 * (r2 + 0.0) / 2
    assert returns.tolist() == approx([r0, 0.5, r2, 0.0, 1.0, 3.0])


def test_tree_returns_rejects_a_child_before_its_parent():
    with pytest.raises(ValueError, match="parents must come before their children"):
        tree_returns(torch.tensor([1.0, 1.0]), torch.tensor([1, -1]), 1.0)


# ------------------------------------------------------------------ hand-computed trees


def test_aligned_two_turn_tree_returns_and_advantages_match_hand_computation():
    # turn 0, slot g: (a, b) = (1, 0), (0, 0)  ->  rewards 1, 0
    # children of joint action 0: (1, 1), (0, 1) -> 2, 1; children of joint action 1: (0, 0), (1, 1) -> 0, 2
    rollout, _ = run_tree([1, 0, 0, 0] + [1, 1, 0, 1] + [0, 0, 1, 1])
    by_turn = {t: [ja for ja in rollout.joint_actions if ja.turn == t] for t in (0, 1)}
    assert [ja.reward for ja in by_turn[0]] == [1.0, 0.0]
    assert [ja.reward for ja in by_turn[1]] == [2.0, 1.0, 0.0, 2.0]
    root_returns = [1 + 0.9 * (2 + 1) / 2, 0 + 0.9 * (0 + 2) / 2]  # 2.35, 0.9
    assert [ja.value for ja in by_turn[0]] == approx(root_returns)
    assert [ja.value for ja in by_turn[1]] == approx([2.0, 1.0, 0.0, 2.0])  # leaves: R = r

    root, child0, child1 = normalized(root_returns), normalized([2, 1]), normalized([0, 2])
    assert [ja.advantage for ja in by_turn[0]] == approx(root)
    assert [ja.advantage for ja in by_turn[1]] == approx(child0 + child1)
    # Aligned credit: both agents' completion g gets A(g).
    turn0 = advantages_by(rollout, 0)
    for g in (0, 1):
        assert turn0[((0, -1, 0), g, "a")] == approx(root[g])
        assert turn0[((0, -1, 0), g, "b")] == approx(root[g])
    turn1 = advantages_by(rollout, 1)
    for node, expected in (((1, 0, 0), child0), ((1, 0, 1), child1)):
        for g in (0, 1):
            assert turn1[(node, g, "a")] == approx(expected[g])
            assert turn1[(node, g, "b")] == approx(expected[g])
    assert len(rollout.samples) == 2 * 2 + 2 * 2 * 2  # root: G slots x N agents; two children alike


def test_cross_two_turn_tree_returns_and_per_agent_credit_match_hand_computation():
    # turn 0: a = (1, 0), b = (0, 1); joint actions (g_a, g_b) in row-major order: rewards 1, 2, 0, 1
    script = [1, 0, 0, 1]
    # child nodes in the order of their parents; within one: slot 0 (a, b), slot 1 (a, b)
    script += [1, 1, 1, 1]  # child of (0,0): every joint action 2
    script += [0, 0, 0, 0]  # child of (0,1): every joint action 0
    script += [1, 0, 0, 0]  # child of (1,0): a = (1, 0), b = (0, 0) -> rewards 1, 1, 0, 0
    script += [0, 1, 0, 0]  # child of (1,1): a = (0, 0), b = (1, 0) -> rewards 1, 0, 1, 0
    rollout, _ = run_tree(script, joint_mode="cross")
    root = [ja for ja in rollout.joint_actions if ja.turn == 0]
    assert [ja.index for ja in root] == [0, 1, 2, 3]
    assert [ja.reward for ja in root] == [1.0, 2.0, 0.0, 1.0]
    root_returns = [1 + 0.9 * 2, 2 + 0.9 * 0, 0 + 0.9 * 0.5, 1 + 0.9 * 0.5]  # 2.8, 2.0, 0.45, 1.45
    assert [ja.value for ja in root] == approx(root_returns)
    A = normalized(root_returns)
    assert [ja.advantage for ja in root] == approx(A)

    # An agent's completion gets the mean advantage of the joint actions it took part in.
    turn0 = advantages_by(rollout, 0)
    node = (0, -1, 0)
    assert turn0[(node, 0, "a")] == approx((A[0] + A[1]) / 2)
    assert turn0[(node, 1, "a")] == approx((A[2] + A[3]) / 2)
    assert turn0[(node, 0, "b")] == approx((A[0] + A[2]) / 2)
    assert turn0[(node, 1, "b")] == approx((A[1] + A[3]) / 2)

    turn1 = advantages_by(rollout, 1)
    # child of (0,0): all rewards equal -> zero advantages
    assert all(turn1[((1, 0, 0), g, agent)] == 0.0 for g in (0, 1) for agent in AGENTS)
    # child of (1,0): rewards 1, 1, 0, 0 -> agent a's first completion is the better one, b's do not matter
    child = normalized([1, 1, 0, 0])
    assert turn1[((1, 0, 2), 0, "a")] == approx((child[0] + child[1]) / 2)
    assert turn1[((1, 0, 2), 1, "a")] == approx((child[2] + child[3]) / 2)
    assert turn1[((1, 0, 2), 0, "b")] == approx(0.0, abs=1e-6)
    assert turn1[((1, 0, 2), 1, "b")] == approx(0.0, abs=1e-6)
    # child of (1,1): rewards 1, 0, 1, 0 -> b's first completion is the better one
    child = normalized([1, 0, 1, 0])
    assert turn1[((1, 0, 3), 0, "b")] == approx((child[0] + child[2]) / 2)
    assert turn1[((1, 0, 3), 0, "a")] == approx(0.0, abs=1e-6)
    assert len(rollout.samples) == 4 + 4 * 4


def test_every_node_sees_its_own_prompt_group_only():
    examples = [{"prompt": "first"}] * 2 + [{"prompt": "second"}] * 2
    rollout, _ = run_tree([1, 0, 0, 0, 0, 0, 1, 1], num_turns=1, examples=examples)
    nodes = {ja.node: ja.branch.example["prompt"] for ja in rollout.joint_actions}
    assert nodes == {(0, -1, 0): "first", (0, -1, 1): "second"}
    assert [s.group for s in rollout.samples] == [0, 0, 0, 0, 1, 1, 1, 1]


# ------------------------------------------------------------------ early termination and done


def test_early_termination_prunes_exactly_the_nodes_whose_mean_reward_reached_the_threshold():
    # T=3. Root rewards 1, 0 (mean 0.5 < 1.5): both expand. Child of 0: 2, 1 (mean 1.5): stops. Child of 1: 0, 2
    # (mean 1.0): expands into two turn-2 nodes.
    script = [1, 0, 0, 0] + [1, 1, 0, 1] + [0, 0, 1, 1] + [0, 0, 0, 0] + [1, 1, 1, 1]
    rollout, _ = run_tree(script, num_turns=3, termination_threshold=1.5)
    turn1 = [ja for ja in rollout.joint_actions if ja.turn == 1]
    assert [ja.terminated for ja in turn1] == [True, True, False, False]
    turn2_parents = {ja.branch.parent for ja in rollout.joint_actions if ja.turn == 2}
    assert turn2_parents == {rollout.joint_actions.index(turn1[2]), rollout.joint_actions.index(turn1[3])}
    assert [stats["num_nodes"] for stats in rollout.turn_stats] == [1.0, 2.0, 2.0]
    # Terminated joint actions are leaves; the expanded ones add their children's mean.
    assert [ja.value for ja in turn1] == approx([2.0, 1.0, 0.0 + 0.9 * 0.0, 2.0 + 0.9 * (2 + 2) / 2])
    assert len(rollout.samples) == 4 + 8 + 8


def test_a_node_below_the_threshold_is_expanded():
    rollout, _ = run_tree([1, 0, 0, 0] + [1, 1, 0, 1] + [0, 0, 1, 1], termination_threshold=0.51)
    assert not any(ja.terminated for ja in rollout.joint_actions if ja.turn == 0)
    assert rollout.turn_stats[1]["num_nodes"] == 2.0


def test_done_from_the_transition_ends_only_that_branch():
    def stop_after_a_success(prompt, joint_action, history, turn, reward, **kwargs):
        return NextTurn(done=True) if reward >= 1 else [prompt, prompt]

    # Root rewards 1 (done) and 0 (continues): one child node only.
    rollout, _ = run_tree([1, 0, 0, 0] + [0, 0, 1, 1], transition=stop_after_a_success)
    root = [ja for ja in rollout.joint_actions if ja.turn == 0]
    assert [ja.done for ja in root] == [True, False]
    assert {ja.branch.parent for ja in rollout.joint_actions if ja.turn == 1} == {1}
    assert root[0].value == approx(1.0)  # a leaf
    assert root[1].value == approx(0.0 + 0.9 * (0 + 2) / 2)


def test_transition_decides_what_each_agent_sees_next_turn():
    seen = []

    def private_feedback(prompt, joint_action, history, turn, observations, level, **kwargs):
        seen.append((prompt, dict(joint_action), list(history), turn, dict(observations), level))
        return {"b": f"b sees {joint_action['a']}", "a": f"a sees {joint_action['b']}"}

    rollout, team = run_tree([1, 0, 0, 0] + [0] * 8, transition=private_feedback, scheduler=ShowsOnlyTheTransition())
    assert seen[0] == ("task", {"a": "1", "b": "0"}, [], 0, {"a": "task", "b": "task"}, 1)
    assert seen[1][1] == {"a": "0", "b": "0"}
    turn1_inputs = team.model_inputs[1]
    # child of joint action 0: G copies of (a's view, b's view), then the child of joint action 1
    assert turn1_inputs == ["<a> a sees 0", "<b> b sees 1"] * 2 + ["<a> a sees 0", "<b> b sees 0"] * 2
    assert [s.model_input for s in rollout.samples if s.turn == 1] == turn1_inputs
    child = [ja for ja in rollout.joint_actions if ja.turn == 1][0]
    assert child.branch.history == [{"a": "1", "b": "0"}]


def test_default_transition_gives_every_agent_the_task_prompt_again():
    assert default_transition(prompt="Plan a trip.", observations={"a": "x", "b": "y"}) == ["Plan a trip."] * 2


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (["only one"], "returned 1 prompts after turn 0; expected 2 prompts, one per agent ['a', 'b']"),
        ({"a": "x", "c": "y"}, "returned prompts for agents ['a', 'c']"),
        ("one string", "returned str after turn 0"),
        ([3, "x"], "returned 3 as the prompt of agent 'a'"),
    ],
)
def test_a_transition_with_the_wrong_prompts_is_an_error_naming_it(returned, message):
    def bad_feedback(**kwargs):
        return returned

    with pytest.raises(TransitionError, match="Transition 'bad_feedback'") as error:
        run_tree([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], transition=bad_feedback)
    assert message in str(error.value)


def test_a_transition_that_raises_is_an_error_naming_it_and_the_turn():
    def flaky_tests(**kwargs):
        raise OSError("sandbox unavailable")

    with pytest.raises(TransitionError, match="Transition 'flaky_tests' raised OSError after turn 0: sandbox"):
        run_tree([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], transition=flaky_tests)


# ------------------------------------------------------------------ rows into micro-batches


def test_pad_rows_adds_loss_free_copies_of_a_real_row_up_to_the_requested_count():
    samples = {
        "prompt_ids": torch.tensor([[5, 6], [7, 8], [9, 10]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0], [1, 1]]),
        "advantages": torch.tensor([0.5, -1.0, 0.25]),
        "agent_index": torch.tensor([1, 0, 1]),
        "num_items_in_batch": torch.tensor(5),
        "old_per_token_logps": None,
    }
    padded = pad_rows(samples, 5)
    assert padded["prompt_ids"].tolist() == [[5, 6], [7, 8], [9, 10], [5, 6], [5, 6]]
    assert padded["agent_index"].tolist() == [1, 0, 1, 1, 1]
    assert padded["completion_mask"][3:].sum() == 0 and padded["advantages"][3:].tolist() == [0.0, 0.0]
    assert padded["advantages"][:3].tolist() == [0.5, -1.0, 0.25]
    assert padded["is_padding"].tolist() == [False, False, False, True, True]
    assert padded["num_items_in_batch"].item() == 5 and padded["old_per_token_logps"] is None


def test_pad_rows_to_the_same_count_adds_nothing():
    samples = {"advantages": torch.tensor([1.0, 2.0]), "completion_mask": torch.ones(2, 3)}
    padded = pad_rows(samples, 2)
    assert padded["advantages"].tolist() == [1.0, 2.0] and not padded["is_padding"].any()


def test_prompt_copies_of_different_rows_in_one_group_are_an_error_naming_the_sampler():
    examples = [{"prompt": "task", "level": 1}, {"prompt": "task", "level": 2}]  # one group of G=2, two rows
    with pytest.raises(ValueError, match=r"Rows 0 and 1 .* different dataset rows.*RepeatSampler"):
        run_tree([1, 2, 3, 4], examples=examples)


def test_batch_scaling_divides_by_the_std_of_every_return_of_the_batch_all_turns():
    # The tree of test_aligned_two_turn_tree_returns_and_advantages_match_hand_computation, with scale_rewards="batch".
    rollout, _ = run_tree([1, 0, 0, 0] + [1, 1, 0, 1] + [0, 0, 1, 1], scale_rewards="batch")
    returns = [2.35, 0.9, 2.0, 1.0, 0.0, 2.0]  # turn 0 (root), then the two child nodes of turn 1
    batch_std = statistics.stdev(returns)  # every return of the batch, not only those of one turn
    by_turn = {t: [ja.advantage for ja in rollout.joint_actions if ja.turn == t] for t in (0, 1)}
    root_mean = (2.35 + 0.9) / 2
    assert by_turn[0] == approx([(r - root_mean) / (batch_std + 1e-4) for r in (2.35, 0.9)])
    assert by_turn[1] == approx([(r - m) / (batch_std + 1e-4) for r, m in zip([2, 1, 0, 2], [1.5, 1.5, 1, 1])])
    # zero-std fraction counts nodes whose own returns are all equal: none here
    assert [stats["frac_reward_zero_std"] for stats in rollout.turn_stats] == [0.0, 0.0]


class Opaque:
    """A value whose `repr` names its address, as a decoded image's does: every copy of a row gets a new one."""


def test_copies_of_one_row_with_opaque_values_are_one_row():
    examples = [{"prompt": "task", "image": Opaque(), "pixels": np.zeros(5000)} for _ in range(2)]  # new objects
    assert repr(examples[0]) != repr(examples[1])
    assert row_digest(examples[0]) == row_digest(examples[1])
    run_tree([1, 2, 3, 4] + [0] * 8, examples=examples)  # no error


def test_rows_that_differ_inside_a_large_array_are_different_rows():
    different = np.zeros(5000)
    different[2500] = 1.0
    examples = [{"prompt": "task", "pixels": np.zeros(5000)}, {"prompt": "task", "pixels": different}]
    assert repr(examples[0]) == repr(examples[1])  # numpy elides the middle: a repr cannot tell them apart
    with pytest.raises(ValueError, match=r"Rows 0 and 1 .* different dataset rows.*RepeatSampler"):
        run_tree([1, 2, 3, 4], examples=examples)
    tensors = [{"prompt": "task", "ids": torch.zeros(5000)}, {"prompt": "task", "ids": torch.zeros(5000)}]
    tensors[1]["ids"][2500] = 1.0
    assert row_digest(tensors[0]) != row_digest(tensors[1])
