"""MAGRPO's tree rollout and its tree types, independent of any model (docs/design.md, §5).

At a node every agent samples G completions; joint actions combine them (aligned: G, cross: G^N); each joint action
of turn t < T−1 opens a child node unless the node's mean team reward reached `termination_threshold` or the
transition says the episode is `done`. The caller supplies generation, scoring and gathering, so the same tree code
trains (`MAGRPOTrainer`), runs a saved team (`load_team`) and is tested with stand-ins.

Layout. The root nodes are the sampler's prompt groups: G consecutive dataset rows (prompt copies), which may span
processes, each copy being one *slot* (one completion per agent). A child node has G slots, all on the process that
holds its parent joint action. Node keys are `(turn, process, index)` with `process = -1` and `index` = the global
group for root nodes. A node's joint actions are numbered in row-major order of the agents' completion indices, as in
`advantages.py`; in cross mode slot g holds the joint actions in which the first agent plays g.
"""

import copy
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.trainer.utils import nanstd

from .advantages import cross_joint_indices, node_credit, team_rewards, tree_returns
from .rollout import (
    EpisodeRollout,
    JointAction,
    NodeKey,
    Rollout,
    RolloutSettings,
    Sample,
    TransitionError,
    checked_next_turn,
    generated_rows,
    transition_name,
    with_observation,
)
from .rows import _local, check_group_layout
from .scheduling import Prompt, Said


@dataclass
class TreeBranch:
    """One path from the root of a MAGRPO tree: the dataset row, what each agent is shown at this turn, and the
    earlier turns. (An AT-GRPO episode copy is `atgrpo_rollout.EpisodeBranch`.)"""

    example: dict
    observations: list[Prompt]  # per agent: the task prompt of this turn (transition's), before scheduler and role
    history: list[Said]  # what was said at each earlier turn: acting agent name -> text
    parent: int  # index (in this process's joint actions) of the joint action this branch continues; -1 at the root
    latest: dict[str, str] = field(default_factory=dict)  # every agent's latest answer (the team's state)
    state: Any = None  # the task's environment state (`Task.reset` / `Task.step`) at the start of this turn


@dataclass
class TreeSlot:
    node: NodeKey
    position: int  # g: which of the node's G completions per agent
    branch: TreeBranch
    # the slot's own environment (`environment_factory=`): a root slot's made for it, a child slot's a copy of its
    # parent joint action's, so that siblings never see each other's tool calls
    environment: Any = None


class TreeRollout(EpisodeRollout):
    """Builds one batch of MAGRPO trees, scores every joint action, and assigns returns, advantages and credit.

    Args:
        settings: the agents, turns, reward weights, baseline and scaling, transition, scheduler and task hooks
            ([`~trl_marl.RolloutSettings`]). Here a node whose mean team reward reaches
            `termination_threshold` is not expanded, and `step` is applied for each acting agent of a joint action, in
            agent order, to the joint action's own copy of its branch's state.
        num_generations: G, completions per agent at each node.
        joint_mode: `"aligned"` or `"cross"`.
        discount: γ of the returns.
        process_index: this process's rank; part of child node keys.
    """

    def __init__(
        self,
        settings: RolloutSettings,
        num_generations: int,
        joint_mode: str = "aligned",
        discount: float = 1.0,
        process_index: int = 0,
    ):
        super().__init__(settings, num_generations)
        self.joint_mode = joint_mode
        self.discount = discount
        self.process_index = process_index
        self.step = settings.step
        everyone_at_once = [list(range(self.num_agents))]
        if joint_mode == "cross" and any(phases != everyone_at_once for phases in self.phases):
            raise ValueError(
                f"`joint_mode='cross'` needs every agent to act at once at every turn, but the scheduler "
                f"{getattr(self.scheduler, 'name', self.scheduler)!r} schedules {self.phases}: a later agent's "
                "answers are conditioned on one earlier answer each, so they cannot be recombined. Use "
                "`joint_mode='aligned'`."
            )
        self.joint_actions_per_node = num_generations if joint_mode == "aligned" else num_generations**self.num_agents
        self.children_per_joint_action = num_generations  # slots of each child node (a critic's trajectories: 1)
        if self.environment is not None and joint_mode == "cross":
            raise ValueError(
                "`joint_mode='cross'` recombines completions sampled in different episodes, which an environment "
                "(`environment_factory=`) cannot follow: each completion's tool calls changed its own episode's "
                "environment. Use `joint_mode='aligned'`."
            )

    def run(
        self,
        examples: list[dict],
        first_copy: int,
        generate: Callable[[list, list[int]], tuple[list, list, list[str]]],
        score: Callable[[list[JointAction]], torch.Tensor],
        gather: Callable[[list], list] = _local,
    ) -> Rollout:
        """Roll out the trees of this process's prompt copies.

        Args:
            examples: dataset rows, G consecutive copies per prompt (a group may continue on other processes).
            first_copy: global index of `examples[0]` among all processes' copies.
            generate: `f(model_inputs, agent_index)` → `(prompt_ids, completion_ids, texts)`, one per row.
            score: `f(joint_actions)` → `(J, F)` rewards per reward function (NaN where a function does not apply).
            gather: concatenates a list over processes (every process calls it in the same order); identity when
                there is one process.
        """
        num_generations, num_agents = self.num_generations, self.num_agents
        check_group_layout(examples, first_copy, num_generations, gather)
        slots = []
        for row, example in enumerate(examples):
            environment, observation = self.environment(example) if self.environment else (None, None)
            task_prompt = with_observation(example["prompt"], observation)
            branch = TreeBranch(example, [task_prompt] * num_agents, [], -1, state=self.reset(example))
            node = (0, -1, (first_copy + row) // num_generations)
            slots.append(TreeSlot(node, (first_copy + row) % num_generations, branch, environment))
        samples, joint_actions = [], []
        for turn in range(self.num_turns):
            if turn > 0 and not slots:  # turn 0 runs on every process: its groups may span them
                break
            root = turn == 0
            per_slot = self._sample(turn, slots, generate)
            turn_samples = [sample for samples in per_slot for _, sample in sorted(samples.items())]
            turn_joint_actions = self._joint_actions(turn, slots, per_slot, gather if root else _local)
            self._score(turn_joint_actions, score)
            first = len(joint_actions)
            samples += turn_samples
            joint_actions += turn_joint_actions
            if turn < self.num_turns - 1:
                stopped = self._terminated_nodes(turn_joint_actions, gather if root else _local)
                slots = self._expand(turn, first, turn_joint_actions, stopped)

        values = tree_returns(
            torch.tensor([ja.reward for ja in joint_actions]),
            torch.tensor([ja.branch.parent for ja in joint_actions], dtype=torch.long),
            self.discount,
        )
        for joint_action, value in zip(joint_actions, values.tolist()):
            joint_action.value = value
        table = gather(
            [(ja.turn, ja.node, ja.index, ja.reward, ja.value, ja.rewards_per_func) for ja in joint_actions]
        )
        turn_stats = self._assign_advantages(samples, joint_actions, table)
        batch_rewards_per_func = torch.tensor([entry[5] for entry in table]).view(len(table), -1)
        batch_turns = torch.tensor([entry[0] for entry in table], dtype=torch.long)
        return Rollout(samples, joint_actions, turn_stats, batch_rewards_per_func, batch_turns)

    # ------------------------------------------------------------------ one turn

    def _sample(self, turn: int, slots: list[TreeSlot], generate: Callable) -> list[dict[int, Sample]]:
        """Every acting agent's completion in every slot, phase by phase (one `generate` call per phase); a later
        phase is shown what earlier phases said in its slot. Returns, per slot, agent index -> sample."""
        per_slot = [{} for _ in slots]
        for phase in self.phases[turn]:
            model_inputs, rows = [], []
            for i, slot in enumerate(slots):
                current = {self.agent_names[a]: sample.text for a, sample in per_slot[i].items()}
                for agent in phase:
                    observed = self.scheduler.observe(
                        agent, slot.branch.observations[agent], slot.branch.history, current, self.agent_names
                    )
                    model_inputs.append(self.settings.agent_input(agent, observed))
                    rows.append((i, agent))
            agents = [agent for _, agent in rows]
            environments = {"environments": [slots[i].environment for i, _ in rows]} if self.environment else {}
            generated = generated_rows(generate(model_inputs, agents, **environments))
            tool_masks = generated.tool_masks or [None] * len(rows)
            for (i, agent), *values, tool_mask in zip(
                rows, model_inputs, generated.prompt_ids, generated.completion_ids, generated.texts, tool_masks
            ):
                slot = slots[i]
                per_slot[i][agent] = Sample(
                    turn, slot.node, slot.position, agent, *values, example=slot.branch.example, tool_mask=tool_mask
                )
        return per_slot

    def _joint_actions(
        self, turn: int, slots: list[TreeSlot], per_slot: list[dict[int, Sample]], gather: Callable
    ) -> list[JointAction]:
        names = self.agent_names

        def joint_action(slot, index, members: dict[int, Sample | tuple[str, list[int]]]):
            members = {a: (m.text, m.completion_ids) if isinstance(m, Sample) else m for a, m in members.items()}
            said = {names[a]: text for a, (text, _) in sorted(members.items())}
            latest = {**{name: slot.branch.latest.get(name, "") for name in names}, **said}
            completion_ids = {names[a]: ids for a, (_, ids) in members.items()}
            state = slot.branch.state
            if self.step is not None and state is not None:
                state = copy.deepcopy(state)  # the joint action's own: its child branches continue from it
                for name, text in said.items():
                    state = self.step(state, name, text, turn)
            joint_action = JointAction(turn, slot.node, index, slot.branch, latest, completion_ids, said, state=state)
            joint_action.environment = slot.environment  # aligned: the slot's own (cross has none)
            return joint_action

        if self.joint_mode == "aligned":
            return [joint_action(slot, slot.position, samples) for slot, samples in zip(slots, per_slot)]
        # Cross (every agent acts at once): the other agents' completions of a root group may be on other processes.
        completions_at = dict(
            gather(
                [
                    ((slot.node, slot.position), [(s.text, s.completion_ids) for _, s in sorted(samples.items())])
                    for slot, samples in zip(slots, per_slot)
                ]
            )
        )
        # Joint action k takes completion layout[k][a] of agent a; agent 0's is the slot's own (rows of the slot's
        # position), the other agents' come from the node's other slots.
        layout = cross_joint_indices(self.num_agents, self.num_generations).tolist()
        per_position = self.num_generations ** (self.num_agents - 1)
        result = []
        for slot, samples in zip(slots, per_slot):
            for index in range(slot.position * per_position, (slot.position + 1) * per_position):
                members = {0: samples[0]} | {
                    a: completions_at[(slot.node, g)][a] for a, g in enumerate(layout[index]) if a > 0
                }
                result.append(joint_action(slot, index, members))
        return result

    def _score(self, joint_actions: list[JointAction], score: Callable) -> None:
        rewards_per_func = score(joint_actions)
        rewards = team_rewards(rewards_per_func, self.settings.reward_weights)
        for joint_action, per_func, reward in zip(joint_actions, rewards_per_func.tolist(), rewards.tolist()):
            joint_action.rewards_per_func, joint_action.reward = per_func, reward

    def _terminated_nodes(self, joint_actions: list[JointAction], gather: Callable) -> set[NodeKey]:
        if self.settings.termination_threshold is None:
            return set()
        rewards = defaultdict(list)
        for node, reward in gather([(ja.node, ja.reward) for ja in joint_actions]):
            if reward == reward:  # NaN: unscorable
                rewards[node].append(reward)
        threshold = self.settings.termination_threshold
        return {node for node, values in rewards.items() if sum(values) / len(values) >= threshold}

    def _stopped(self, joint_action: JointAction, stopped: set) -> bool:
        """Whether early termination ends `joint_action`'s branch (`stopped`: `_terminated_nodes`'s answer)."""
        return joint_action.node in stopped

    def _expand(self, turn: int, first: int, joint_actions: list[JointAction], stopped: set) -> list[TreeSlot]:
        slots = []
        for offset, joint_action in enumerate(joint_actions):
            if self._stopped(joint_action, stopped):
                joint_action.terminated = True
                continue
            prompts, done = self._next_turn(joint_action)
            if done:
                joint_action.done = True
                continue
            node = (turn + 1, self.process_index, first + offset)  # unique: one child node per joint action
            history = [*joint_action.branch.history, joint_action.said]
            branch = TreeBranch(
                joint_action.branch.example,
                prompts,
                history,
                first + offset,
                joint_action.completions,
                state=joint_action.state,
            )
            children = self.children_per_joint_action
            environments = [copy.deepcopy(joint_action.environment) for _ in range(children)]
            slots += [TreeSlot(node, g, branch, environments[g]) for g in range(children)]
        return slots

    def _next_turn(self, joint_action: JointAction) -> tuple[list[Prompt], bool]:
        name = transition_name(self.settings.transition)
        example = joint_action.branch.example
        columns = {key: value for key, value in example.items() if key != "prompt"}
        try:
            result = self.settings.transition(
                **columns,
                prompt=example["prompt"],
                joint_action=dict(joint_action.said),
                history=list(joint_action.branch.history),
                turn=joint_action.turn,
                observations=dict(zip(self.agent_names, joint_action.branch.observations)),
                reward=joint_action.reward,
                **({"state": joint_action.state} if joint_action.state is not None else {}),
            )
        except Exception as error:
            raise TransitionError(
                f"Transition '{name}' raised {type(error).__name__} after turn {joint_action.turn}: {error}"
            ) from error
        return checked_next_turn(name, result, self.agent_names, joint_action.turn)

    # ------------------------------------------------------------------ advantages

    def _assign_advantages(
        self, samples: list[Sample], joint_actions: list[JointAction], table: list[tuple]
    ) -> list[dict[str, float]]:
        """Advantages among the siblings of every node, from the joint actions of all processes (`table`: root groups
        span processes, and `scale_rewards="batch"` divides by the std of every return of the batch, all turns and
        processes, as TRL divides by the std of its whole batch); each process keeps its own back."""
        size = self.joint_actions_per_node
        all_values = torch.tensor([entry[4] for entry in table], dtype=torch.float32)
        batch_std = nanstd(all_values) if all_values.numel() > 1 else torch.zeros(())
        turn_stats, node_row, first_group = [], {}, 0
        for turn in range(self.num_turns):
            rows = [entry for entry in table if entry[0] == turn]
            if not rows:
                break
            nodes = sorted({entry[1] for entry in rows})
            index_of = {node: i for i, node in enumerate(nodes)}
            rewards = torch.full((len(nodes), size), math.nan)
            values = torch.full((len(nodes), size), math.nan)
            filled = torch.zeros(len(nodes), size, dtype=torch.bool)
            for _, node, k, reward, value, _ in rows:
                rewards[index_of[node], k], values[index_of[node], k], filled[index_of[node], k] = reward, value, True
            if not filled.all():
                raise RuntimeError(f"Turn {turn} has incomplete nodes: joint actions were lost between processes.")
            credit, advantages, std = node_credit(
                values,
                self.joint_mode,
                self.num_agents,
                self.num_generations,
                self.settings.baseline,
                self.settings.scale_rewards,
                batch_std,
            )
            for node, i in index_of.items():
                node_row[node] = (first_group + i, credit[i], advantages[i])
            first_group += len(nodes)
            turn_stats.append(
                {
                    "reward": torch.nanmean(rewards).item(),
                    "return": torch.nanmean(values).item(),
                    "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).float().mean().item(),
                    "num_nodes": float(len(nodes)),
                    "num_joint_actions": float(len(rows)),
                }
            )
        for joint_action in joint_actions:
            joint_action.advantage = node_row[joint_action.node][2][joint_action.index].item()
        for sample in samples:
            group, credit, _ = node_row[sample.node]
            sample.group, sample.advantage = group, credit[sample.position, sample.agent].item()
        return turn_stats
