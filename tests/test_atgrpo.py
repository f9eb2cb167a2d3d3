"""AT-GRPO's rollout with scripted stand-ins for the model: groups, greedy continuation, state, α mixing, processes."""

import math
import random
import statistics
import threading
from collections import defaultdict

import pytest
import torch

from trl_marl.rollouts.advantages import ADVANTAGE_EPS
from trl_marl.rollouts.atgrpo_rollout import ATGRPORollout, choose
from trl_marl.rollouts.rollout import RolloutSettings
from trl_marl.rollouts.scheduling import parallel, sequential

NAMES = ["a", "b"]


class Scripted:
    """`generate` stand-in: row r of a call by agent `a` says `texts[a][r % len(texts[a])]`; records every call."""

    def __init__(self, texts):
        self.texts, self.calls = texts, []

    def __call__(self, model_inputs, agents):
        self.calls.append((list(model_inputs), list(agents)))
        texts = [self.texts[agent][row % len(self.texts[agent])] for row, agent in enumerate(agents)]
        return [[1, 2]] * len(texts), [[3, 4]] * len(texts), texts


def team_score(reward):
    """`score` stand-in: one team reward function, `reward(joint_action)`."""
    return lambda joint_actions: torch.tensor([[float(reward(ja))] for ja in joint_actions]).view(-1, 1)


def rollout(num_generations=3, num_turns=1, **overrides):
    values = dict(
        agent_names=NAMES,
        num_generations=num_generations,
        num_turns=num_turns,
        reward_weights=torch.ones(1),
        team_reward_weight=1.0,
        continuation="greedy",
        baseline="mean",
        scale_rewards="group",
        transition=lambda prompt, **kwargs: [prompt, prompt],
        agent_input=lambda agent, prompt: f"<{NAMES[agent]}> {prompt}",
        scheduler=sequential,
    )
    values.update(overrides)
    own_keys = ("num_generations", "team_reward_weight", "continuation", "seed")
    own = {key: values.pop(key) for key in own_keys if key in values}
    return ATGRPORollout(RolloutSettings(**values), **own)


def copies(problems, num_generations):
    return [dict(problem) for problem in problems for _ in range(num_generations)]


def grouped(samples):
    groups = defaultdict(list)
    for sample in samples:
        groups[sample.group].append(sample)
    return groups


def advantages(rewards):
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    return [(r - mean) / (std + ADVANTAGE_EPS) for r in rewards]


def test_a_group_never_mixes_problems_and_all_its_members_saw_one_prompt():
    problems = [{"prompt": f"problem {i}", "id": i} for i in range(3)]
    texts = {0: ["1", "22", "333"], 1: ["x", "yy", "zzz"]}
    result = rollout(num_turns=2).run(
        copies(problems, 3), 0, Scripted(texts), team_score(lambda ja: len(ja.completions["a"]))
    )
    groups = grouped(result.samples)
    assert len(groups) == 3 * 2 * 2  # problems × turns × agents
    for members in groups.values():
        assert sorted(s.position for s in members) == [0, 1, 2]
        assert len({s.example["id"] for s in members}) == 1
        assert len({s.agent for s in members}) == 1 and len({s.turn for s in members}) == 1
        assert len({str(s.model_input) for s in members}) == 1


def test_later_agents_get_non_zero_advantages_when_only_their_choice_matters():
    texts = {0: ["same"], 1: ["good", "bad", "bad"]}
    result = rollout().run(
        copies([{"prompt": "p"}], 3), 0, Scripted(texts), team_score(lambda ja: ja.completions["b"] == "good")
    )
    by_agent = {agent: [s.advantage for s in result.samples if s.agent == agent] for agent in (0, 1)}
    assert by_agent[0] == [0.0, 0.0, 0.0]
    assert by_agent[1] == pytest.approx(advantages([1.0, 0.0, 0.0]))
    assert by_agent[1][0] > 0.5


def test_every_branch_continues_from_its_own_copy_of_the_chosen_state():
    steps = []

    def step(state, agent, text, turn):
        steps.append((agent, turn, list(state)))
        state.append(f"{agent}:{text}")
        return state

    texts = {0: ["low", "best", "mid"], 1: ["x", "y", "z"]}
    score = {"low": 0, "best": 2, "mid": 1, "x": 0, "y": 0, "z": 1}
    generate = Scripted(texts)
    seen_by_transition = []

    def transition(prompt, state, **kwargs):
        seen_by_transition.append(list(state))
        return [f"{prompt} | state {state}"] * 2

    result = rollout(num_turns=2, reset=lambda example: [], step=step, transition=transition).run(
        copies([{"prompt": "p"}], 3), 0, generate, team_score(lambda ja: score[ja.said[next(iter(ja.said))]])
    )
    # Agent b stepped from the chosen candidate of a ("best"), in every branch, not from a stale or sibling state.
    assert [state for agent, turn, state in steps if agent == "b" and turn == 0] == [["a:best"]] * 3
    # The transition built turn 1 from the state after b's choice ("z"), and a's turn-1 prompt shows it.
    assert seen_by_transition == [["a:best", "b:z"]] * 3
    turn_1_inputs_of_a = generate.calls[2][0]
    assert all("state ['a:best', 'b:z']" in model_input for model_input in turn_1_inputs_of_a)
    # b saw a's chosen answer of this turn through the sequential scheduler.
    assert all("best" in model_input for model_input in generate.calls[1][0])
    branches = {id(ja.branch): ja.branch for ja in result.joint_actions}.values()
    final = ["a:best", "b:z", "a:best", "b:z"]
    assert [branch.state for branch in branches] == [final] * 3
    assert len({id(branch.state) for branch in branches}) == 3  # one state object per branch


def test_alpha_mixes_team_and_local_rewards_as_hand_computed():
    texts = {0: ["t1", "t0", "t1b"], 1: ["-"]}
    local = {"t1": 0.2, "t0": 0.4, "t1b": 0.0, "-": 0.0}
    result = rollout(team_reward_weight=0.5).run(
        copies([{"prompt": "p"}], 3),
        0,
        Scripted(texts),
        team_score(lambda ja: float(ja.completions["a"].startswith("t1"))),
        local_score=lambda agent, jas: [local[ja.said[NAMES[agent]]] for ja in jas],
    )
    first = [s for s in result.samples if s.agent == 0]
    rewards = [0.5 * 1 + 0.2, 0.5 * 0 + 0.4, 0.5 * 1 + 0.0]
    assert [ja.reward for ja in result.joint_actions[:3]] == pytest.approx(rewards)
    assert [s.advantage for s in first] == pytest.approx(advantages(rewards))
    assert result.metrics["turns/0/agents/a/chosen_reward"] == pytest.approx(0.7)
    assert result.metrics["agents/a/local_reward"] == pytest.approx(0.2)
    # b's candidates all score 1 from a's chosen "t1" (team) + 0 (local): one zero-std group.
    assert result.metrics["turns/0/agents/b/frac_reward_zero_std"] == 1.0


def test_the_transition_gets_the_team_reward_of_the_joint_action_the_turn_ended_on_not_the_mixed_one():
    """As under MAGRPO, a transition's `reward` is the team reward: α · team + local is what ranks candidates."""
    texts = {0: ["t1", "t0", "t1b"], 1: ["b1", "b2", "b3"]}
    local = {"t1": 0.2, "t0": 0.4, "t1b": 0.0, "b1": 0.3, "b2": 0.0, "b3": 0.1}
    rewards_seen = []

    def transition(prompt, reward, **kwargs):
        rewards_seen.append(reward)
        return [prompt, prompt]

    team = {"b1": 0.25, "b2": 0.5, "b3": 0.0}
    rollout(team_reward_weight=0.5, num_turns=2, transition=transition).run(
        copies([{"prompt": "p"}], 3),
        0,
        Scripted(texts),
        team_score(lambda ja: team.get(ja.completions["b"], 0.0)),
        local_score=lambda agent, jas: [local[ja.said[NAMES[agent]]] for ja in jas],
    )
    # b's mixed rewards 0.5·0.25 + 0.3, 0.5·0.5 + 0, 0.5·0 + 0.1: "b1" is chosen (0.425); its team reward is 0.25.
    assert rewards_seen == [0.25] * 3


def test_greedy_takes_the_first_best_and_sample_only_scorable_candidates():
    rng = random.Random(0)
    assert choose([1.0, 1.0, 0.0], "greedy", rng) == 0
    assert choose([math.nan, 0.2, 0.5], "greedy", rng) == 2
    assert choose([math.nan, math.nan], "greedy", rng) == 0
    picks = {choose([math.nan, 0.0, 1.0, 0.5], "sample", rng) for _ in range(200)}
    assert picks == {1, 2, 3}


def test_success_rate_and_episode_length_come_from_the_task():
    result = rollout(
        num_generations=2,
        num_turns=3,
        reset=lambda example: {"total": 0},
        step=lambda state, agent, text, turn: {"total": state["total"] + int(text)},
        success=lambda example, state, completions: state["total"] >= example["goal"],
        termination_threshold=1.0,
    ).run(
        copies([{"prompt": "p", "goal": 2}, {"prompt": "q", "goal": 100}], 2),
        0,
        Scripted({0: ["1"], 1: ["1"]}),
        team_score(lambda ja: float(ja.state["total"] >= ja.branch.example["goal"])),
    )
    # The first problem reaches its goal after turn 0 and stops (threshold); the second runs all 3 turns and fails.
    assert result.metrics["episodes/success_rate"] == 0.5
    assert result.metrics["episodes/num_turns"] == 2.0
    assert len(grouped(result.samples)) == 2 + 3 * 2


def test_episode_team_reward_scores_the_joint_action_each_episode_ended_on():
    # Parallel, one turn: `a` acts first, so its candidates are scored with `b` still silent (team reward 0); `b`'s
    # are scored with `a`'s chosen answer. Team reward: 0 if either is silent, else len(b's answer) / 10.
    result = rollout(num_generations=2, scheduler=parallel).run(
        copies([{"prompt": "p"}, {"prompt": "q"}], 2),
        0,
        Scripted({0: ["x"], 1: ["yy", "yyyy", "yyy", "y"]}),
        team_score(lambda ja: len(ja.completions["b"]) / 10 if ja.completions["a"] and ja.completions["b"] else 0.0),
    )
    # p ends on "yyyy" (0.4, the better of 0.2 and 0.4), q on "yyy" (0.3, the better of 0.3 and 0.1).
    assert result.metrics["episodes/team_reward"] == pytest.approx(0.35)
    # The mean over every candidate counts a's four zeros: (0.2 + 0.4 + 0.3 + 0.1) / 8.
    assert result.batch_rewards_per_func.mean().item() == pytest.approx(0.125)


def test_episode_team_reward_is_left_out_when_no_team_reward_applies():
    result = rollout(num_generations=2, scheduler=parallel).run(
        copies([{"prompt": "p"}], 2), 0, Scripted({0: ["x"], 1: ["y"]}), team_score(lambda ja: math.nan)
    )
    assert "episodes/team_reward" not in result.metrics and result.metrics["episodes/num_turns"] == 1.0


class Processes:
    """A `gather` per simulated process: each call waits for every process, then returns the concatenation."""

    def __init__(self, count):
        self.barrier, self.parts = threading.Barrier(count), [None] * count

    def gather_for(self, rank):
        def gather(items):
            self.parts[rank] = list(items)
            self.barrier.wait()
            result = [item for part in self.parts for item in part]
            self.barrier.wait()
            return result

        return gather


def test_a_problem_split_over_processes_continues_from_one_choice_on_both():
    examples = copies([{"prompt": f"problem {i}"} for i in range(3)], 2)  # 6 copies: problem 1 spans both ranks
    processes, results = Processes(2), {}

    def run(rank):
        generate = Scripted({0: [f"r{rank}-{row}" for row in range(3)], 1: [f"s{rank}-{row}" for row in range(3)]})
        results[rank] = rollout(num_generations=2, num_turns=2, reset=lambda example: [],
                                step=lambda state, agent, text, turn: [*state, text]).run(
            examples[3 * rank : 3 * rank + 3], 3 * rank, generate,
            team_score(lambda ja: int(ja.said[next(iter(ja.said))][1]) + int(ja.said[next(iter(ja.said))][-1])),
            gather=processes.gather_for(rank),
        )  # fmt: skip

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spanning = [ja.branch for rank in (0, 1) for ja in results[rank].joint_actions if ja.branch.episode == 1]
    assert {branch.position for branch in spanning} == {0, 1}
    assert len({tuple(branch.state) for branch in spanning}) == 1  # both ranks continued from the same choices
    # The group of problem 1, turn 0, agent a has one member per rank: r0-2 (reward 2) and r1-0 (reward 1).
    members = [s for rank in (0, 1) for s in results[rank].samples if s.node == (1, 0, 0)]
    assert sorted((s.text, round(s.advantage, 4)) for s in members) == [
        ("r0-2", round(advantages([2.0, 1.0])[0], 4)),
        ("r1-0", round(advantages([2.0, 1.0])[1], 4)),
    ]
    assert spanning[0].state[0] == "r0-2"  # the greedy choice, taken by both ranks
    assert results[0].metrics == results[1].metrics


def test_copies_of_different_rows_in_one_group_are_an_error_naming_the_sampler():
    problems = [{"prompt": f"problem {i}", "id": i} for i in range(2)]
    interleaved = [dict(problems[copy_index % 2]) for copy_index in range(6)]  # p0 p1 p0 p1 ...: not G in a row
    generate = Scripted({0: ["1"], 1: ["x"]})
    with pytest.raises(ValueError, match=r"Rows 0 and 1 .* different dataset rows.*RepeatSampler.*_get_train_sampler"):
        rollout(num_generations=3).run(interleaved, 0, generate, team_score(lambda ja: 1.0))
    assert generate.calls == [], "nothing is generated for a batch with a broken layout"


def test_a_group_spanning_processes_is_checked_across_them():
    # copies 0-1: problem 0 on rank 0; copies 2-3: problem 1 on rank 0 and ... problem 2 on rank 1
    parts = [[{"prompt": "problem 0"}] * 2 + [{"prompt": "problem 1"}], [{"prompt": "problem 2"}] * 3]
    processes, errors = Processes(2), {}

    def run(rank):
        try:
            rollout(num_generations=2).run(
                parts[rank], 3 * rank, Scripted({0: ["1"], 1: ["x"]}), team_score(lambda ja: 1.0),
                gather=processes.gather_for(rank),
            )  # fmt: skip
        except ValueError as error:
            errors[rank] = str(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(errors) == [0, 1] and all("Rows 2 and 3 " in message for message in errors.values())


def test_batch_scaling_divides_by_the_batch_std_and_zero_std_counts_each_group_alone():
    texts = {0: ["1", "22", "333"], 1: ["x", "yy", "zzz"]}
    result = rollout(scale_rewards="batch").run(
        copies([{"prompt": "p"}], 3), 0, Scripted(texts), team_score(lambda ja: len(ja.completions["a"]))
    )
    # a's candidates score 1, 2, 3; b acts after a's best ("333"), so its three candidates all score 3
    batch_std = statistics.stdev([1, 2, 3, 3, 3, 3])
    by_agent = {agent: [s.advantage for s in result.samples if s.agent == agent] for agent in (0, 1)}
    assert by_agent[0] == pytest.approx([(r - 2) / (batch_std + ADVANTAGE_EPS) for r in (1, 2, 3)])
    assert by_agent[1] == pytest.approx([0.0, 0.0, 0.0])
    assert result.metrics["turns/0/agents/a/frac_reward_zero_std"] == 0.0
    assert result.metrics["turns/0/agents/b/frac_reward_zero_std"] == 1.0
    assert result.turn_stats[0]["frac_reward_zero_std"] == 0.5


class PerAgentScript:
    """`generate` stand-in whose n-th row for agent `a` (over all calls) says `texts[a][n]`, whatever the calls'
    grouping; records each call's agents."""

    def __init__(self, texts):
        self.texts, self.counts, self.calls = texts, defaultdict(int), []

    def __call__(self, model_inputs, agents):
        self.calls.append(list(agents))
        texts = []
        for agent in agents:
            texts.append(self.texts[agent][self.counts[agent] % len(self.texts[agent])])
            self.counts[agent] += 1
        return [[1, 2]] * len(texts), [[3, 4]] * len(texts), texts


class ParallelViewInTwoPhases(type(parallel)):
    """What each agent sees under `parallel`, but one phase per agent: one generate call per agent."""

    def phases(self, turn, num_agents):
        return [[agent] for agent in range(num_agents)]

    def observe(self, agent, prompt, history, current, names):
        return super().observe(agent, prompt, history, {}, names)  # nothing of this turn, as in one parallel phase


def test_agents_of_one_phase_share_one_generate_call_with_unchanged_groups_and_advantages():
    texts = {0: ["1", "22", "333", "4444"], 1: ["x", "yy", "zzz", "w"]}
    state = dict(reset=lambda example: [], step=lambda state, agent, text, turn: [*state, text])
    score = team_score(lambda ja: len(ja.completions["a"]) * 2 - len(ja.completions["b"]) + len(ja.state))
    examples = copies([{"prompt": "p"}, {"prompt": "q"}], 2)
    one_call, two_calls = PerAgentScript(texts), PerAgentScript(texts)
    grouped_run = rollout(num_generations=2, num_turns=2, scheduler=parallel, **state).run(
        examples, 0, one_call, score
    )
    reference = rollout(num_generations=2, num_turns=2, scheduler=ParallelViewInTwoPhases(), **state).run(
        examples, 0, two_calls, score
    )
    assert one_call.calls == [[0, 0, 0, 0, 1, 1, 1, 1]] * 2  # one call per phase (= per turn), both agents' rows
    assert two_calls.calls == [[0] * 4, [1] * 4] * 2

    def outcome(result):
        return [
            (s.node, s.position, s.text, str(s.model_input), s.group, round(s.advantage, 6)) for s in result.samples
        ]

    assert outcome(grouped_run) == outcome(reference)
    assert any(s.advantage != 0 for s in grouped_run.samples if s.agent == 1)
    assert grouped_run.metrics == reference.metrics
