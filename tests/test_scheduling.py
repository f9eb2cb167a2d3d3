"""Turn schedulers: for a 3-agent, 2-turn episode, who acts and the exact prompt each agent sees at each turn."""

import pytest
import torch

from trl_marl import MAGRPOConfig, MAGRPOTrainer
from trl_marl.registry import load_plugin
from trl_marl.rollouts.magrpo_rollout import TreeRollout
from trl_marl.rollouts.rollout import RolloutSettings, default_transition
from trl_marl.rollouts.scheduling import Parallel, scheduled_phases

NAMES = ["ann", "bob", "cy"]
TASK = "Plan a picnic."


def episode(scheduler_name, joint_mode="aligned"):
    """One greedy-style episode (G=1) where each completion names its author and turn, e.g. 'ann@1'; returns the
    prompt every agent was shown at every turn, in the order the agents acted."""
    seen = []

    def generate(model_inputs, agent_index):
        texts = []
        for prompt, agent in zip(model_inputs, agent_index):
            turn = 1 if "turn 2" in prompt else 0
            seen.append((turn, NAMES[agent], prompt))
            texts.append(f"{NAMES[agent]}@{turn}")
        return [[0]] * len(texts), [[1]] * len(texts), texts

    settings = RolloutSettings(
        agent_names=NAMES,
        num_turns=2,
        termination_threshold=None,
        reward_weights=torch.ones(1),
        baseline="none",
        scale_rewards="none",
        transition=default_transition,
        agent_input=lambda agent, prompt: prompt,
        scheduler=load_plugin("schedulers", scheduler_name),
    )
    rollout = TreeRollout(settings, num_generations=1, joint_mode=joint_mode, discount=1.0)
    score = lambda joint_actions: torch.zeros(len(joint_actions), 1)  # noqa: E731
    rollout = rollout.run([{"prompt": TASK}], first_copy=0, generate=generate, score=score)
    return seen, rollout


def shown(said: str, turn: int) -> str:
    """The task followed by what the agent may see of the team's answers, as the built-in schedulers write it."""
    return f"{TASK}\n\nYour team's answers so far:\n\n{said}\n\nGive your answer for turn {turn}."


def test_parallel_all_act_and_each_sees_every_earlier_answer():
    seen, _ = episode("parallel")
    after_turn_1 = shown("Turn 1:\n[ann] ann@0\n[bob] bob@0\n[cy] cy@0", 2)
    assert seen == [(0, name, TASK) for name in NAMES] + [(1, name, after_turn_1) for name in NAMES]


def test_sequential_agents_act_in_order_and_see_this_turns_earlier_answers():
    seen, _ = episode("sequential")
    assert seen[:3] == [
        (0, "ann", TASK),
        (0, "bob", shown("Turn 1:\n[ann] ann@0", 1)),
        (0, "cy", shown("Turn 1:\n[ann] ann@0\n[bob] bob@0", 1)),
    ]
    turn_1 = "Turn 1:\n[ann] ann@0\n[bob] bob@0\n[cy] cy@0"
    assert seen[3:] == [
        (1, "ann", shown(turn_1, 2)),
        (1, "bob", shown(f"{turn_1}\n\nTurn 2:\n[ann] ann@1", 2)),
        (1, "cy", shown(f"{turn_1}\n\nTurn 2:\n[ann] ann@1\n[bob] bob@1", 2)),
    ]


def test_round_robin_one_agent_per_turn_and_the_reward_sees_every_latest_answer():
    seen, rollout = episode("round_robin")
    assert seen == [(0, "ann", TASK), (1, "bob", shown("Turn 1:\n[ann] ann@0", 2))]
    # the team's state: everyone's latest answer, empty before an agent's first turn
    assert [ja.completions for ja in rollout.joint_actions] == [
        {"ann": "ann@0", "bob": "", "cy": ""},
        {"ann": "ann@0", "bob": "bob@1", "cy": ""},
    ]
    assert [s.agent for s in rollout.samples] == [0, 1]


def test_round_robin_blind_shows_each_agent_its_prompt_only_and_the_reward_still_sees_every_latest_answer():
    seen, rollout = episode("round_robin_blind")
    assert seen == [(0, "ann", TASK), (0, "bob", TASK)]  # bob is not shown ann's answer (its label reads turn 0)
    assert [ja.completions for ja in rollout.joint_actions][-1] == {"ann": "ann@0", "bob": "bob@0", "cy": ""}


def test_parallel_blind_lets_everyone_act_at_every_turn_shown_only_the_turn_prompt():
    seen, rollout = episode("parallel_blind")
    assert seen == [(0, name, TASK) for name in NAMES] * 2  # the transcript `parallel` appends is left out
    assert [ja.completions for ja in rollout.joint_actions][-1] == {name: f"{name}@0" for name in NAMES}


def test_debate_each_sees_the_others_previous_answers_not_its_own():
    seen, _ = episode("debate")
    assert seen[:3] == [(0, name, TASK) for name in NAMES]

    def others(me):
        lines = "\n".join(f"[{n}] {n}@0" for n in NAMES if n != me)
        return f"{TASK}\n\nThe other agents answered:\n{lines}\n\nGive your answer for turn 2."

    assert seen[3:] == [(1, name, others(name)) for name in NAMES]


def test_cross_joint_actions_need_every_agent_to_act_at_once():
    with pytest.raises(ValueError, match="`joint_mode='cross'` needs every agent to act at once.*'sequential'"):
        episode("sequential", joint_mode="cross")


class Listed(Parallel):
    """A scheduler plugin that returns fixed phases for every turn."""

    name = "listed"

    def __init__(self, phases):
        self.listed = phases

    def phases(self, turn, num_agents):
        return self.listed


@pytest.mark.parametrize(
    ("phases", "problem"),
    [
        ([[0], [1], [0]], "agent 0 acts twice"),
        ([[0, 1, 1]], "agent 1 acts twice"),
        ([[0], [2]], r"agent index 2 is not one of the 2 agents \(0-1\)"),
        ([[0], [True]], r"True is not an agent index \(an integer\)"),
        ([["critic"]], r"'critic' is not an agent index \(an integer\)"),
        ([], "no agent acts"),
    ],
)
def test_a_scheduler_that_lists_an_agent_twice_or_a_missing_one_is_refused_before_the_model_loads(phases, problem):
    """A group is one agent's candidates from one state: an agent acting twice in a turn would collide with itself
    (AT-GRPO's (problem, turn, agent) key; MAGRPO's one answer per agent and turn)."""
    args = MAGRPOConfig(output_dir="unused", agents=["writer", "critic"], report_to="none", use_cpu=True)
    reward = lambda prompts, completions, **kwargs: [0.0] * len(completions)  # noqa: E731
    dataset = [{"prompt": "Say hi."}]
    with pytest.raises(ValueError, match=rf"Scheduler 'listed' .* turn 0 .*: {problem}\. An agent acts at most once"):
        MAGRPOTrainer("no/such-model", reward, args=args, train_dataset=dataset, scheduler=Listed(phases))


def test_a_schedule_of_numpy_integers_is_read_as_agent_indices():
    numpy = pytest.importorskip("numpy")
    assert scheduled_phases(Listed([list(numpy.arange(2))]), num_agents=2, num_turns=1) == [[[0, 1]]]
    assert type(scheduled_phases(Listed([numpy.arange(2)]), num_agents=2, num_turns=1)[0][0][0]) is int
