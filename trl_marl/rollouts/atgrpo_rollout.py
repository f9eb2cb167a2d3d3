"""AT-GRPO's rollout (arXiv 2510.11062; docs/design.md, §6), independent of any model.

Every problem is played as one episode along a single path. At each turn the acting agents act one after another in
the scheduler's order; for the acting agent, each of the problem's G copies (TRL's repeated rows, here *branches*)
samples one candidate from the same state, so the G candidates of (problem, turn, agent) form one group. Each
candidate is scored on a copy of the state, r = α · team reward + the agent's local reward; advantages are computed
within the group. The episode then continues from the best candidate (argmax, ties to the first; or a sampled one):
its text and its state are copied into every branch, and the next agent acts from there.

A problem's copies may sit on several processes; the choice is made from gathered scores, identically everywhere,
and the chosen state travels with them (it must be picklable). Every process takes the same number of steps, so
collective calls stay aligned.
"""

import copy
import math
import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .advantages import group_advantages, team_rewards
from .rollout import (
    EpisodeRollout,
    JointAction,
    Rollout,
    RolloutSettings,
    Sample,
    TransitionError,
    checked_next_turn,
    generated_rows,
    transition_name,
    with_observation,
)
from .rows import check_group_layout
from .scheduling import Prompt, Said

# How an episode continues after a turn: from the best candidate, or from a sampled one (`ATGRPOConfig.continuation`).
CONTINUATIONS = ("greedy", "sample")

GroupKey = tuple[int, int, int]  # (episode, turn, agent): the episode is the problem's global prompt-group index


@dataclass
class EpisodeBranch:
    """One copy of a problem's episode: the dataset row, the environment state, and what the team said so far."""

    example: dict
    episode: int  # the problem: global index of its prompt group (the G copies of one dataset row)
    position: int  # which of the G copies
    observations: list[Prompt]  # per agent: the task prompt of this turn, before scheduler and role
    state: Any = None  # the task's environment state (`Task.reset` / `Task.step`); one object per branch
    environment: Any = None  # the episode's environment (`environment_factory=`); one object per branch
    history: list[Said] = field(default_factory=list)
    latest: dict[str, str] = field(default_factory=dict)  # every agent's latest chosen answer
    done: bool = False


@dataclass
class Candidate:
    """One sampled action of the acting agent in one branch, scored on its own copy of the state."""

    sample: Sample
    joint_action: JointAction
    state: Any
    team_reward: float
    local_reward: float | None
    reward: float  # α · team + local: what the group compares


def choose(rewards: list[float], continuation: str, rng: random.Random) -> int:
    """Index of the candidate the episode continues from: the highest reward (ties: the first), or with
    `continuation="sample"` a uniformly random scorable one. Unscorable (NaN) candidates are chosen only when every
    candidate is."""
    scorable = [k for k, reward in enumerate(rewards) if reward == reward]
    if not scorable:
        return 0
    if continuation == "sample":
        return rng.choice(scorable)
    return max(scorable, key=lambda k: (rewards[k], -k))


def mixed_rewards(team: torch.Tensor, local: list[float] | None, alpha: float) -> list[float]:
    """r = α · team + local for each candidate (local 0 when the agent has no local reward)."""
    local = local if local is not None else [0.0] * len(team)
    return [alpha * t + own for t, own in zip(team.tolist(), local)]


class ATGRPORollout(EpisodeRollout):
    """Builds one batch of AT-GRPO episodes and assigns group advantages.

    Args:
        settings: the agents, turns, reward weights, baseline and scaling, transition (which also receives `state`
            when the task keeps one), scheduler and task hooks ([`~trl_marl.RolloutSettings`]). Here an episode
            ends after a turn whose last chosen candidate's team reward reached `termination_threshold`.
        num_generations: G, candidates per (problem, turn, agent) group.
        team_reward_weight: α.
        continuation: `"greedy"` (argmax) or `"sample"`.
        seed: seeds `continuation="sample"`, identically on every process.
    """

    def __init__(
        self,
        settings: RolloutSettings,
        num_generations: int,
        team_reward_weight: float = 1.0,
        continuation: str = "greedy",
        seed: int = 0,
    ):
        if continuation not in CONTINUATIONS:
            raise ValueError(f"`continuation` must be one of {list(CONTINUATIONS)}, got {continuation!r}.")
        super().__init__(settings, num_generations)
        self.alpha = team_reward_weight
        self.continuation = continuation
        self.step = settings.step or (lambda state, agent, text, turn: state)
        self.success = settings.success or (lambda example, state, completions: None)
        self.rng = random.Random(seed)

    def run(
        self,
        examples: list[dict],
        first_copy: int,
        generate: Callable[[list, list[int]], tuple[list, list, list[str]]],
        score: Callable[[list[JointAction]], torch.Tensor],
        local_score: Callable[[int, list[JointAction]], list[float] | None] = lambda *_: None,
        gather: Callable[[list], list] = list,
    ) -> Rollout:
        """Play this process's problem copies.

        Args:
            examples: dataset rows, G consecutive copies per problem (a problem's copies may continue on other
                processes).
            first_copy: global index of `examples[0]` among all processes' copies.
            generate: `f(model_inputs, agent_indices)` → `(prompt_ids, completion_ids, texts)`, one per row.
            score: `f(joint_actions)` → `(J, F)` team rewards per reward function (NaN where one does not apply).
            local_score: `f(agent_index, joint_actions)` → the acting agent's local reward of each candidate, or None
                when it has none.
            gather: concatenates a list over processes (every process calls it in the same order).
        """
        num_generations = self.num_generations
        check_group_layout(examples, first_copy, num_generations, gather)
        branches = []
        for row, example in enumerate(examples):
            copy_index = first_copy + row
            state = self.reset(example)  # must depend on the row only: every copy starts from the same state
            environment, observation = self.environment(example) if self.environment else (None, None)
            observations = [with_observation(example["prompt"], observation)] * self.num_agents
            branches.append(
                EpisodeBranch(example, copy_index // num_generations, copy_index % num_generations, observations)
            )
            branches[-1].state, branches[-1].environment = state, environment
        candidates: list[Candidate] = []
        chosen: dict[GroupKey, tuple[int, float, float]] = {}  # group -> (position, reward, team reward)
        for turn in range(self.num_turns):
            said_this_turn = [{} for _ in branches]
            for phase in self.phases[turn]:
                active = [i for i, branch in enumerate(branches) if not branch.done]
                acting = [branches[i] for i in active]
                # Agents of one phase do not see each other's answers: their prompts are fixed when the phase begins,
                # so one generate call serves them all. Each is then scored and continued in turn, the next one from
                # the state (and team answers) its predecessor's chosen candidate left. With an environment, each agent
                # of the phase generates after its predecessor's choice (same prompts), its tool calls acting on the
                # environment that choice left.
                seen = [dict(said_this_turn[i]) for i in active]
                generated = self._generate_phase(phase, acting, seen, generate) if not self.environment else {}
                for agent in phase:
                    if self.environment:  # its tool calls act on the environment its predecessor's choice left
                        generated[agent] = self._generate_phase([agent], acting, seen, generate)[agent]
                    step_candidates = self._candidates(turn, agent, acting, generated[agent], score, local_score)
                    candidates += step_candidates
                    self._continue(turn, agent, active, branches, step_candidates, said_this_turn, chosen, gather)
            for i, branch in enumerate(branches):
                if branch.done:
                    continue
                branch.history.append(said_this_turn[i])
                reached = self._reached_threshold(turn, branch, chosen)
                if turn < self.num_turns - 1 and not reached:
                    branch.observations, branch.done = self._next_turn(branch, turn, chosen)
                else:
                    branch.done = True
        return self._finish(branches, candidates, chosen, gather)

    # ------------------------------------------------------------------ one agent's step

    def _generate_phase(self, phase, branches, seen, generate) -> dict[int, list[tuple]]:
        """Every agent of `phase` samples one candidate in every branch, in one `generate` call. Returns, per agent,
        one `(model_input, prompt_ids, completion_ids, text, tool_mask, environment)` per branch: each candidate acts
        on its own copy of its branch's environment (when there is one)."""
        if not branches:
            return {agent: [] for agent in phase}
        names = self.agent_names
        model_inputs, agents, environments = [], [], []
        for agent in phase:
            for branch, current in zip(branches, seen):
                prompt = self.scheduler.observe(
                    agent, branch.observations[agent], branch.history, dict(current), names
                )
                model_inputs.append(self.settings.agent_input(agent, prompt))
                agents.append(agent)
                environments.append(copy.deepcopy(branch.environment))
        options = {"environments": environments} if self.environment else {}
        generated = generated_rows(generate(model_inputs, agents, **options))
        tool_masks = generated.tool_masks or [None] * len(model_inputs)
        rows = list(zip(model_inputs, *generated[:3], tool_masks, environments))
        return {agent: rows[k * len(branches) : (k + 1) * len(branches)] for k, agent in enumerate(phase)}

    def _candidates(self, turn, agent, branches, generated, score, local_score) -> list[Candidate]:
        """Score the acting agent's candidates, each on its own copy of its branch's state."""
        if not branches:
            return []
        names = self.agent_names
        states, joint_actions, samples = [], [], []
        for branch, (model_input, ids, completion, text, tool_mask, environment) in zip(branches, generated):
            state = self.step(copy.deepcopy(branch.state), names[agent], text, turn)
            states.append(state)
            node = (branch.episode, turn, agent)
            joint_actions.append(
                JointAction(
                    turn,
                    node,
                    branch.position,
                    branch,
                    completions={**{name: branch.latest.get(name, "") for name in names}, names[agent]: text},
                    completion_ids={names[agent]: completion},
                    said={names[agent]: text},
                    state=state,
                    environment=environment,
                )
            )
            samples.append(
                Sample(
                    turn,
                    node,
                    branch.position,
                    agent,
                    model_input,
                    ids,
                    completion,
                    text,
                    example=branch.example,
                    tool_mask=tool_mask,
                )  # fmt: skip
            )
        rewards_per_func = score(joint_actions)
        team = team_rewards(rewards_per_func, self.settings.reward_weights)
        local = local_score(agent, joint_actions)
        rewards = mixed_rewards(team, local, self.alpha)
        result = []
        for k, (sample, joint_action, state) in enumerate(zip(samples, joint_actions, states)):
            joint_action.rewards_per_func = rewards_per_func[k].tolist()
            joint_action.reward = joint_action.value = rewards[k]
            local_k = None if local is None else float(local[k])
            result.append(Candidate(sample, joint_action, state, team[k].item(), local_k, rewards[k]))
        return result

    def _continue(self, turn, agent, active, branches, step_candidates, said_this_turn, chosen, gather) -> None:
        """Choose each group's candidate from the gathered scores and copy its text and state into every branch of
        the problem."""
        name = self.agent_names[agent]
        table = gather(
            [
                (
                    c.sample.node,
                    c.sample.position,
                    c.reward,
                    c.team_reward,
                    c.sample.text,
                    c.state,
                    c.joint_action.environment,
                )  # fmt: skip
                for c in step_candidates
            ]
        )
        groups = defaultdict(dict)
        for node, position, reward, team, text, state, environment in table:
            groups[node][position] = (reward, team, text, state, environment)
        winners = {}
        for node in sorted(groups):
            members = groups[node]
            positions = sorted(members)
            k = choose([members[p][0] for p in positions], self.continuation, self.rng)
            winners[node] = members[positions[k]]
            chosen[node] = (positions[k], members[positions[k]][0], members[positions[k]][1])
        for i in active:
            branch = branches[i]
            _, _, text, state, environment = winners[(branch.episode, turn, agent)]
            branch.latest[name] = text
            said_this_turn[i][name] = text
            branch.state = copy.deepcopy(state)  # one object per branch: no branch shares (or keeps) a stale state
            branch.environment = copy.deepcopy(environment)

    # ------------------------------------------------------------------ between turns

    def _turn_outcome(self, branch: EpisodeBranch, turn: int, chosen) -> tuple[int, float, float]:
        """(position, reward, team reward) of the candidate chosen for the last agent to act in `turn`: the joint
        action the turn ended on."""
        last_agent = [agent for phase in self.phases[turn] for agent in phase][-1]
        return chosen[(branch.episode, turn, last_agent)]

    def _reached_threshold(self, turn: int, branch: EpisodeBranch, chosen) -> bool:
        if self.settings.termination_threshold is None:
            return False
        team = self._turn_outcome(branch, turn, chosen)[2]
        return team == team and team >= self.settings.termination_threshold

    def _next_turn(self, branch: EpisodeBranch, turn: int, chosen) -> tuple[list[Prompt], bool]:
        name = transition_name(self.settings.transition)
        columns = {key: value for key, value in branch.example.items() if key != "prompt"}
        extra = {"state": branch.state} if branch.state is not None else {}
        try:
            result = self.settings.transition(
                **columns,
                prompt=branch.example["prompt"],
                joint_action=dict(branch.history[-1]),
                history=list(branch.history[:-1]),
                turn=turn,
                observations=dict(zip(self.agent_names, branch.observations)),
                reward=self._turn_outcome(branch, turn, chosen)[2],  # the team reward, as under MAGRPO
                **extra,
            )
        except Exception as error:
            raise TransitionError(
                f"Transition '{name}' raised {type(error).__name__} after turn {turn}: {error}"
            ) from error
        prompts, done = checked_next_turn(name, result, self.agent_names, turn)
        return (prompts if not done else branch.observations), done

    # ------------------------------------------------------------------ advantages and statistics

    def _finish(self, branches, candidates, chosen, gather) -> Rollout:
        table = gather(
            [
                (
                    c.sample.node,
                    c.sample.position,
                    c.reward,
                    c.team_reward,
                    c.local_reward,
                    c.joint_action.rewards_per_func,
                )
                for c in candidates
            ]
        )
        nodes = sorted({entry[0] for entry in table})
        index_of = {node: i for i, node in enumerate(nodes)}
        size = self.num_generations
        rewards = torch.full((len(nodes), size), math.nan)
        filled = torch.zeros(len(nodes), size, dtype=torch.bool)
        for node, position, reward, *_ in table:
            rewards[index_of[node], position], filled[index_of[node], position] = reward, True
        if not filled.all():
            raise RuntimeError("AT-GRPO groups are incomplete: candidates were lost between processes.")
        advantages, std = group_advantages(rewards, self.settings.baseline, self.settings.scale_rewards)
        for c in candidates:
            i = index_of[c.sample.node]
            c.sample.group = i
            c.sample.advantage = c.joint_action.advantage = advantages[i, c.sample.position].item()

        # Statistics over every process's groups.
        turn_stats, metrics = [], {}
        for turn in range(self.num_turns):
            of_turn = [i for node, i in index_of.items() if node[1] == turn]
            if not of_turn:
                break
            zero_std = torch.isclose(std[of_turn, 0], torch.zeros(len(of_turn))).float()
            turn_stats.append(
                {
                    "reward": torch.nanmean(rewards[of_turn]).item(),
                    "return": torch.nanmean(rewards[of_turn]).item(),
                    "frac_reward_zero_std": zero_std.mean().item(),
                    "num_nodes": float(len(of_turn)),
                    "num_joint_actions": float(len(of_turn) * size),
                }
            )
            for agent, name in enumerate(self.agent_names):
                groups = [i for node, i in index_of.items() if node[1] == turn and node[2] == agent]
                if not groups:
                    continue
                prefix = f"turns/{turn}/agents/{name}"
                metrics[f"{prefix}/group_reward_mean"] = torch.nanmean(rewards[groups]).item()
                metrics[f"{prefix}/group_reward_std"] = torch.nanmean(std[groups, 0]).item()
                metrics[f"{prefix}/frac_reward_zero_std"] = (
                    torch.isclose(std[groups, 0], torch.zeros(len(groups))).float().mean().item()
                )
                picked = [chosen[node][1] for node in nodes if node[1] == turn and node[2] == agent]
                metrics[f"{prefix}/chosen_reward"] = sum(picked) / len(picked)
        for agent, name in enumerate(self.agent_names):
            local = [entry[4] for entry in table if entry[0][2] == agent and entry[4] is not None]
            if local:
                metrics[f"agents/{name}/local_reward"] = sum(local) / len(local)
        outcomes = {}
        ends = [(b.episode, len(b.history), self._success(b), self._final_team_reward(b, chosen)) for b in branches]
        for episode, turns, success, team in gather(ends):
            outcomes[episode] = (turns, success, team)
        if outcomes:
            metrics["episodes/num_turns"] = sum(turns for turns, _, _ in outcomes.values()) / len(outcomes)
            judged = [success for _, success, _ in outcomes.values() if success is not None]
            if judged:
                metrics["episodes/success_rate"] = sum(judged) / len(judged)
            scored = [team for _, _, team in outcomes.values() if team == team]  # NaN: no team reward applied
            if scored:
                metrics["episodes/team_reward"] = sum(scored) / len(scored)
        batch_rewards_per_func = torch.tensor([entry[5] for entry in table]).view(len(table), -1)
        batch_turns = torch.tensor([entry[0][1] for entry in table], dtype=torch.long)
        return Rollout(
            [c.sample for c in candidates],
            [c.joint_action for c in candidates],
            turn_stats,
            batch_rewards_per_func,
            batch_turns,
            metrics=metrics,
        )

    def _final_team_reward(self, branch: EpisodeBranch, chosen) -> float:
        """The team reward of the joint action the episode ended on. Unlike the mean over every candidate
        (`rewards/<team reward>/mean`), it never scores a candidate against a teammate who has not answered yet."""
        return self._turn_outcome(branch, len(branch.history) - 1, chosen)[2]

    def _success(self, branch: EpisodeBranch) -> bool | None:
        result = self.success(branch.example, branch.state, dict(branch.latest))
        return None if result is None else bool(result)
