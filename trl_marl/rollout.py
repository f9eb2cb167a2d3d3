"""MAGRPO's tree rollout (DESIGN.md §3), independent of any model.

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
import hashlib
import itertools
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from trl.trainer.utils import get_callable_name, nanstd

from .advantages import node_credit, team_rewards, tree_returns
from .scheduling import Prompt, Said, parallel

NodeKey = tuple[int, int, int]


class TransitionError(RuntimeError):
    """A transition raised, or did not return one next prompt per agent."""


@dataclass
class NextTurn:
    """What a transition returns for one branch: each agent's next prompt (a string or a list of chat messages, in the
    dataset's prompt format), or `done=True` to end the episode after this turn."""

    prompts: Sequence[Prompt] | dict[str, Prompt] | None = None
    done: bool = False


@dataclass
class Branch:
    """One path from the root: the dataset row, what each agent is shown at this turn, and the earlier turns."""

    example: dict
    observations: list[Prompt]  # per agent: the task prompt of this turn (transition's), before scheduler and role
    history: list[Said]  # what was said at each earlier turn: acting agent name -> text
    parent: int  # index (in this process's joint actions) of the joint action this branch continues; -1 at the root
    latest: dict[str, str] = field(default_factory=dict)  # every agent's latest answer (the team's state)
    state: Any = None  # the task's environment state (`Task.reset` / `Task.step`) at the start of this turn


@dataclass
class Slot:
    node: NodeKey
    position: int  # g: which of the node's G completions per agent
    branch: Branch


@dataclass
class Sample:
    """One agent's completion at one node: one training row."""

    turn: int
    node: NodeKey
    position: int
    agent: int
    model_input: Prompt  # what the model was given (role included)
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    advantage: float = 0.0
    group: int = -1  # global index of the node (in sorted node-key order), the same on every process
    example: dict = field(default_factory=dict, repr=False)  # the dataset row


@dataclass
class JointAction:
    turn: int
    node: NodeKey
    index: int  # k within the node
    branch: Branch
    completions: dict[str, str]  # every agent's latest answer: what the team reward scores
    completion_ids: dict[str, list[int]]
    said: Said = field(default_factory=dict)  # the acting agents' answers of this turn
    rewards_per_func: list[float] = field(default_factory=list)
    reward: float = math.nan
    value: float = math.nan  # the return R
    advantage: float = 0.0
    done: bool = False  # the transition ended the episode here
    terminated: bool = False  # early termination: its node's mean reward reached the threshold
    state: Any = None  # AT-GRPO: the task's environment state after this action (a private copy)


@dataclass
class Rollout:
    """A process's samples and joint actions, and per-turn statistics of the whole (all processes) batch."""

    samples: list[Sample]
    joint_actions: list[JointAction]
    turn_stats: list[dict[str, float]]  # per turn: reward, return, zero-std fraction, node / joint-action counts
    batch_rewards_per_func: torch.Tensor  # (J_all, F) over every process's joint actions
    batch_turns: torch.Tensor  # (J_all,)
    metrics: dict[str, float] = field(default_factory=dict)  # algorithm-specific statistics, already over processes


def _local(items: list) -> list:
    return list(items)


def _feed(hasher, value: Any) -> None:
    """Feed a dataset value's contents to `hasher`: equal contents, equal bytes, whatever the objects.

    A row's copies are separate objects (one `__getitem__` each), so identities and memory addresses must not count,
    and arrays must count whole (their `repr` elides the middle of a large one)."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        hasher.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, dict):
        hasher.update(b"{")
        for key in sorted(value, key=repr):
            _feed(hasher, key)
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, list | tuple):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
    elif isinstance(value, torch.Tensor):
        hasher.update(f"tensor{tuple(value.shape)}{value.dtype};".encode())
        hasher.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif callable(getattr(value, "tobytes", None)):  # numpy arrays, PIL images
        shape = getattr(value, "shape", None) or (getattr(value, "mode", None), getattr(value, "size", None))
        hasher.update(f"{type(value).__name__}{shape}{getattr(value, 'dtype', '')};".encode())
        hasher.update(value.tobytes())
    else:  # anything else: its repr, unless that names an address (the default `object.__repr__`)
        text = repr(value)
        hasher.update((type(value).__qualname__ if re.search(r" at 0x[0-9a-fA-F]+", text) else text).encode())


def row_digest(example: dict) -> str:
    """A digest of a dataset row's contents (see `_feed`): two copies of one row get the same one."""
    hasher = hashlib.blake2b(digest_size=8)
    _feed(hasher, example)
    return hasher.hexdigest()


def check_group_layout(
    examples: list[dict], first_copy: int, num_generations: int, gather: Callable[[list], list] = _local
) -> None:
    """Check that the copies grouped as one problem are one dataset row.

    Groups are keyed by the global copy index `// num_generations`: that is right only under the layout of TRL's
    `RepeatSampler`, which yields each dataset row `num_generations` times in a row, identically on every process. A
    sampler that breaks it would silently compare candidates of different problems. A row has no index of its own
    once it reaches the trainer, so rows are compared by a digest of their contents ([`row_digest`]), gathered over
    processes (a group may span them). Identical rows at different dataset indices are one problem to this check,
    which is harmless: their candidates answer the same question.

    Raises:
        ValueError: a group holds copies of different rows; it names the copies and the sampler.
    """
    digests = [(first_copy + row, row_digest(example)) for row, example in enumerate(examples)]
    first_of_group: dict[int, tuple[int, str]] = {}
    for copy_index, digest in gather(digests):
        group = copy_index // num_generations
        first_index, first_digest = first_of_group.setdefault(group, (copy_index, digest))
        if digest != first_digest:
            raise ValueError(
                f"Rows {first_index} and {copy_index} of the generation batch are grouped as copies of one problem "
                f"(every {num_generations} consecutive rows, num_generations={num_generations}) but are different "
                "dataset rows. Groups follow the layout of TRL's `RepeatSampler` (the trainer's "
                "`_get_train_sampler`): each dataset row `num_generations` times in a row, in the same order on "
                "every process. Keep that sampler, or make yours yield that layout; a dataset transform that "
                "returns different contents for the same row (random augmentation) breaks it too."
            )


def default_transition(prompt: Prompt, observations: dict[str, Prompt], **kwargs) -> list[Prompt]:
    """No feedback: every agent gets the task prompt again. What was said reaches it through the scheduler (by
    default `parallel`: the task followed by every earlier turn's answers)."""
    return [prompt] * len(observations)


def transition_name(transition: Callable) -> str:
    return get_callable_name(transition)


def checked_next_turn(name: str, result: Any, agent_names: list[str], turn: int) -> tuple[list[Prompt], bool]:
    """Normalise what a transition returned to `(one prompt per agent, done)`, or raise `TransitionError`."""
    if isinstance(result, NextTurn):
        if result.done:
            return [], True
        result = result.prompts
    expected = f"{len(agent_names)} prompts, one per agent {agent_names}"
    if isinstance(result, dict):
        if sorted(result) != sorted(agent_names):
            raise TransitionError(
                f"Transition '{name}' returned prompts for agents {sorted(result)} after turn {turn}; expected "
                f"{expected}."
            )
        prompts = [result[agent] for agent in agent_names]
    elif isinstance(result, (list, tuple)):
        if len(result) != len(agent_names):
            raise TransitionError(
                f"Transition '{name}' returned {len(result)} prompts after turn {turn}; expected {expected}."
            )
        prompts = list(result)
    else:
        raise TransitionError(
            f"Transition '{name}' returned {type(result).__name__} after turn {turn}; it must return a list of "
            f"{expected}, a dict agent name -> prompt, or trl_marl.NextTurn(prompts=..., done=...)."
        )
    for agent, prompt in zip(agent_names, prompts):
        if (
            not isinstance(prompt, (str, list))
            or isinstance(prompt, list)
            and not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
        ):
            raise TransitionError(
                f"Transition '{name}' returned {prompt!r} as the prompt of agent '{agent}' after turn {turn}; a "
                "prompt is a string or a list of {'role', 'content'} messages."
            )
    return prompts, False


class TreeRollout:
    """Builds one batch of MAGRPO trees, scores every joint action, and assigns returns, advantages and credit.

    Args:
        agent_names: the agents, in order.
        num_generations: G, completions per agent at each node.
        num_turns: T.
        joint_mode: `"aligned"` or `"cross"`.
        discount: γ of the returns.
        termination_threshold: a node whose mean team reward reaches it is not expanded; `None` for never.
        reward_weights: `(F,)` weights of the reward functions.
        baseline, scale_rewards: as [`~trl_marl.advantages.group_advantages`].
        transition: `f(prompt, joint_action, history, turn, observations, reward, **columns)` → each agent's next
            prompt (see [`checked_next_turn`]).
        agent_input: `f(agent_index, prompt)` → the model input of that agent (its role added).
        process_index: this process's rank; part of child node keys.
        scheduler: which agents act at each turn and what each sees (`trl_marl.scheduling`); `parallel` by default.
        reset: `f(example)` → a problem's initial environment state (None: the task keeps none).
        step: `f(state, agent_name, text, turn)` → the state after that agent said `text`; applied for each acting
            agent of a joint action, in agent order, to the joint action's own copy of its branch's state.
    """

    def __init__(
        self,
        agent_names: list[str],
        num_generations: int,
        num_turns: int,
        joint_mode: str,
        discount: float,
        termination_threshold: float | None,
        reward_weights: torch.Tensor,
        baseline: str,
        scale_rewards: str,
        transition: Callable,
        agent_input: Callable[[int, Prompt], Any],
        process_index: int = 0,
        scheduler: Any = parallel,
        reset: Callable[[dict], Any] | None = None,
        step: Callable[..., Any] | None = None,
    ):
        self.agent_names = agent_names
        self.num_agents = len(agent_names)
        self.num_generations = num_generations
        self.num_turns = num_turns
        self.joint_mode = joint_mode
        self.discount = discount
        self.termination_threshold = termination_threshold
        self.reward_weights = reward_weights
        self.baseline = baseline
        self.scale_rewards = scale_rewards
        self.transition = transition
        self.agent_input = agent_input
        self.process_index = process_index
        self.scheduler = scheduler
        self.reset = reset or (lambda example: None)
        self.step = step
        self.phases = [scheduler.phases(turn, self.num_agents) for turn in range(num_turns)]
        everyone_at_once = [list(range(self.num_agents))]
        if joint_mode == "cross" and any(phases != everyone_at_once for phases in self.phases):
            raise ValueError(
                f"`joint_mode='cross'` needs every agent to act at once at every turn, but the scheduler "
                f"{getattr(scheduler, 'name', scheduler)!r} schedules {self.phases}: a later agent's answers are "
                "conditioned on one earlier answer each, so they cannot be recombined. Use `joint_mode='aligned'`."
            )
        self.joint_actions_per_node = num_generations if joint_mode == "aligned" else num_generations**self.num_agents

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
        slots = [
            Slot(
                node=(0, -1, (first_copy + row) // num_generations),
                position=(first_copy + row) % num_generations,
                branch=Branch(example, [example["prompt"]] * num_agents, [], -1, state=self.reset(example)),
            )
            for row, example in enumerate(examples)
        ]
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

    def _sample(self, turn: int, slots: list[Slot], generate: Callable) -> list[dict[int, Sample]]:
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
                    model_inputs.append(self.agent_input(agent, observed))
                    rows.append((i, agent))
            prompt_ids, completion_ids, texts = generate(model_inputs, [agent for _, agent in rows])
            for (i, agent), *values in zip(rows, model_inputs, prompt_ids, completion_ids, texts):
                slot = slots[i]
                per_slot[i][agent] = Sample(
                    turn, slot.node, slot.position, agent, *values, example=slot.branch.example
                )
        return per_slot

    def _joint_actions(
        self, turn: int, slots: list[Slot], per_slot: list[dict[int, Sample]], gather: Callable
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
            return JointAction(turn, slot.node, index, slot.branch, latest, completion_ids, said, state=state)

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
        num_generations, num_agents = self.num_generations, self.num_agents
        result = []
        for slot, samples in zip(slots, per_slot):
            for rest, others in enumerate(itertools.product(range(num_generations), repeat=num_agents - 1)):
                members = {0: samples[0]} | {
                    a + 1: completions_at[(slot.node, g)][a + 1] for a, g in enumerate(others)
                }
                index = slot.position * num_generations ** (num_agents - 1) + rest
                result.append(joint_action(slot, index, members))
        return result

    def _score(self, joint_actions: list[JointAction], score: Callable) -> None:
        rewards_per_func = score(joint_actions)
        rewards = team_rewards(rewards_per_func, self.reward_weights)
        for joint_action, per_func, reward in zip(joint_actions, rewards_per_func.tolist(), rewards.tolist()):
            joint_action.rewards_per_func, joint_action.reward = per_func, reward

    def _terminated_nodes(self, joint_actions: list[JointAction], gather: Callable) -> set[NodeKey]:
        if self.termination_threshold is None:
            return set()
        rewards = defaultdict(list)
        for node, reward in gather([(ja.node, ja.reward) for ja in joint_actions]):
            if reward == reward:  # NaN: unscorable
                rewards[node].append(reward)
        return {node for node, values in rewards.items() if sum(values) / len(values) >= self.termination_threshold}

    def _expand(self, turn: int, first: int, joint_actions: list[JointAction], stopped: set[NodeKey]) -> list[Slot]:
        slots = []
        for offset, joint_action in enumerate(joint_actions):
            if joint_action.node in stopped:
                joint_action.terminated = True
                continue
            prompts, done = self._next_turn(joint_action)
            if done:
                joint_action.done = True
                continue
            node = (turn + 1, self.process_index, first + offset)  # unique: one child node per joint action
            history = [*joint_action.branch.history, joint_action.said]
            branch = Branch(
                joint_action.branch.example,
                prompts,
                history,
                first + offset,
                joint_action.completions,
                state=joint_action.state,
            )
            slots += [Slot(node, g, branch) for g in range(self.num_generations)]
        return slots

    def _next_turn(self, joint_action: JointAction) -> tuple[list[Prompt], bool]:
        name = transition_name(self.transition)
        example = joint_action.branch.example
        columns = {key: value for key, value in example.items() if key != "prompt"}
        try:
            result = self.transition(
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
                self.baseline,
                self.scale_rewards,
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


def pad_rows(samples: dict, num_rows: int) -> dict:
    """Pad a batch of rows to `num_rows` with copies of its first row that carry no loss: completion mask 0,
    advantage 0, and `is_padding` True.

    TRL splits a generation batch into `steps_per_generation` equal micro-batches, and its loss gathers per-row
    metrics over processes, which needs equal row counts on every process; a tree yields a varying number of rows.
    A copy of a real row (rather than an empty one) keeps every forward finite. Tensors with one entry per row are
    padded; 0-dim tensors (`num_items_in_batch`, which counts real tokens only) and `None` are kept.
    """
    num_real = len(samples["advantages"])
    if num_rows < num_real:
        raise ValueError(f"Cannot pad {num_real} rows down to {num_rows}.")
    padded = dict(samples)
    for key, value in samples.items():
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            filler = value[:1].expand(num_rows - num_real, *value.shape[1:])
            if key in ("completion_mask", "advantages"):
                filler = torch.zeros_like(filler)
            padded[key] = torch.cat([value, filler])
    is_padding = torch.zeros(num_rows, dtype=torch.bool, device=samples["advantages"].device)
    is_padding[num_real:] = True
    padded["is_padding"] = is_padding
    return padded


# Loss types that TRL normalises by the rows of a micro-batch (padding rows included) rather than by loss tokens.
PER_ROW_LOSS_TYPES = ("grpo", "sapo", "dr_grpo", "luspo")
# Loss types that TRL normalises by the real tokens of one micro-batch.
MICRO_BATCH_TOKEN_LOSS_TYPES = ("bnpo",)


def padding_loss_scale(
    loss_type: str, rows: int, real_rows: int, total_real_rows: int, num_chunks: int, num_processes: int
) -> float:
    """The factor by which the trainer multiplies TRL's loss of one micro-batch so that padding rows change nothing.

    A generation batch holds `B` rows per process after padding, `R` real rows over the `P` processes
    (`total_real_rows`); TRL splits it into `S` micro-batches (`num_chunks`; 1 in evaluation) of `b = B / S` rows
    (`rows`), `r` of them real (`real_rows`), accumulates GA of them per optimizer step and DDP averages the processes.
    Without padding (`R = P · B`) TRL weighs every row of a generation alike, `S / (GA · R)` (`1 / R` per step when
    `S = GA`); the factor gives the real rows exactly that weight, as if they were the whole generation batch:

    - `grpo`, `sapo` (mean over rows of per-row token means), `dr_grpo` (sum / (rows · max length)) and `luspo` (mean
      over rows of per-row sums) divide a micro-batch by its `b` rows, padding rows included, so a row weighs
      `1 / (GA · P · b)`:  `scale = P · S · b / R`  (= `P · B / R`, the same for every micro-batch).
    - `bnpo` divides a micro-batch by its own real tokens, so padding rows change no micro-batch's loss; but TRL weighs
      every micro-batch `1 / (GA · P)` however few real rows it holds (one that is all padding still counts in the
      average). Weighted by its real rows instead, as every micro-batch holds `b` real rows without padding:
      `scale = P · S · r / R`.
    - `dapo`, `cispo` and `vespo` divide by `num_items_in_batch`, the real tokens of the whole generation over every
      process: exact already, `scale = 1`.

    Without padding (`r = b`, `R = P · S · b`) every factor is 1; with `R = 0` nothing trains and the factor is 1.
    """
    if total_real_rows == 0:
        return 1.0
    if loss_type in PER_ROW_LOSS_TYPES:
        return num_processes * num_chunks * rows / total_real_rows
    if loss_type in MICRO_BATCH_TOKEN_LOSS_TYPES:
        return num_processes * num_chunks * real_rows / total_real_rows
    return 1.0
