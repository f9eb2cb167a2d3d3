"""The rollout's shape, as the planner needs it: the rows and prompt length of each `generate` call, and the rows and
length of a training micro-batch.

MAGRPO turn t (0-based) has `copies·K^t` nodes' worth of rows per acting agent, with K = G (aligned) or G^N (cross)
and `copies = per_device_train_batch_size · steps_per_generation`; AT-GRPO has `copies` rows per agent step. Both
make one `generate` call per scheduler phase, holding every acting agent of the phase (AT-GRPO:
`ATGRPOTrainer._generate_phase`). A micro-batch is the rows of a generation batch divided by `steps_per_generation`.
Prompts at later phases carry the earlier answers: P_t = P + (answers visible before it)·C — every answer of the
episode's earlier phases (the agents of one phase do not see each other's), or under `debate` the other agents'
previous answers — an upper bound that ignores a transition's own feedback text (raise `prompt_length` to cover it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..generation.vllm_limits import VLLM_MAX_NUM_BATCHED_TOKENS

if TYPE_CHECKING:
    from ..config import MAGRPOConfig


@dataclass(frozen=True)
class GenerateCall:
    """One `generate` call of the rollout: its rows and its prompt length in tokens."""

    rows: int
    prompt_length: int


def rollout_geometry(
    config: MAGRPOConfig, prompt_length: int, agents: list[int] | None = None
) -> tuple[list[GenerateCall], int, int]:
    """`(generate calls, training rows per micro-batch, training sequence length)` of one generation batch; with
    `agents` (the agents on one base of a team on several), the rows of those agents only, in their base's own calls,
    with the prompt lengths of the whole team's episode.

    MAGRPO: at turn t (0-based) each acting agent of a scheduler phase answers `copies·K^t` rows in one call per
    phase (K = G aligned, G^N cross); the rows of trained agents are trained. IAC and MAAC: the same with K = 1 (one
    trajectory per copy). AT-GRPO: each scheduler phase is one
    call of `len(phase) · copies` rows (`ATGRPOTrainer._generate_phase`: the phase's agents in one batch). An answer
    is shown, at most, to every later phase's call; the agents of a phase see the answers of earlier phases only, the
    same number for each, so one prompt length, the phase's longest, serves the whole call: P_t = P + (earlier
    answers)·C. The micro-batch holds ⌈rows / steps_per_generation⌉ rows padded to the longest: S = max P_t + C.
    """
    from ..config import ActorCriticConfig, ATGRPOConfig
    from ..rollouts.scheduling import resolve_scheduler

    scheduler = resolve_scheduler(config.scheduler)
    copies = config.per_device_train_batch_size * config.steps_per_generation
    # AT-GRPO and the actor-critic trainers have no tree: each copy continues once per turn
    one_path = isinstance(config, (ATGRPOConfig, ActorCriticConfig))
    per_node = 1 if one_path else config.joint_actions_per_node(config.num_generations)
    members = set(range(config.num_agents) if agents is None else agents)
    trained = {i for i, name in enumerate(config.agent_names) if name not in config.frozen_agents and i in members}
    completion = config.max_completion_length
    calls, train_rows, answers_before = [], 0, 0
    for turn in range(config.num_turns):
        nodes = copies * per_node**turn
        for phase in scheduler.phases(turn, config.num_agents):
            # the agents of a phase see the same earlier answers (their prompts are fixed when the phase begins)
            visible = visible_answers(config.scheduler, turn, answers_before, config.num_agents)
            acting = members.intersection(phase)
            if acting:
                calls.append(GenerateCall(nodes * len(acting), prompt_length + visible * completion))
            train_rows += nodes * len(trained.intersection(phase))
            answers_before += len(phase)
    micro_batch = math.ceil(train_rows / config.steps_per_generation)
    return calls, micro_batch, max(call.prompt_length for call in calls) + completion


def largest_call_rows(config: MAGRPOConfig) -> int:
    """The rows of the rollout's largest `generate` call (`rollout_geometry`): with vLLM, the rows the team engine
    runs at once (`max_num_seqs`, times the tensor-parallel size)."""
    calls, _, _ = rollout_geometry(config, prompt_length=0)
    return max(call.rows for call in calls)


def vllm_max_num_seqs(config: MAGRPOConfig) -> int:
    """vLLM's `max_num_seqs` in the team engine (`TeamVLLMGeneration`): `min(max(TRL's value, largest call's rows ·
    tp), 4096)`, TRL's value being `per_device_train_batch_size · steps_per_generation · tp`, tp =
    `vllm_tensor_parallel_size`, 4096 = `VLLM_MAX_NUM_BATCHED_TOKENS`. TRL sizes it for one policy's prompts; a team
    call holds the rows of every agent of a phase (`agents · copies · K^t` in MAGRPO, `agents · copies` in AT-GRPO),
    so the engine runs the whole largest call at once."""
    tp = config.vllm_tensor_parallel_size
    trl_value = config.per_device_train_batch_size * config.steps_per_generation * tp
    return min(max(trl_value, largest_call_rows(config) * tp), VLLM_MAX_NUM_BATCHED_TOKENS)


def visible_answers(scheduler: str, turn: int, answers_before: int, num_agents: int) -> int:
    """How many earlier answers a prompt shows, at most: the other agents' previous turn under `debate`, every
    earlier answer of the episode otherwise (`parallel`, `sequential`, `round_robin`, and plugins, as a bound)."""
    if scheduler == "debate":
        return num_agents - 1 if turn > 0 else 0
    return answers_before
