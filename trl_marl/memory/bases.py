"""A team on several base models (`trl_marl.team.bases`): each base estimated with its own architecture, precision
and agents (`estimate_memory(..., agents=...)`), then summed as the trainer holds them.

- static: every base's weights, adapters, optimizer states (and captured decode buffers), summed;
- training phase: a micro-batch runs each base's forward on its own rows before the backward, so every base's
  gradients and saved activations are held together (summed), while the log-prob head and the backward working set
  of one base at a time are (the largest). A base's rows are its agents' share of the micro-batch (the shuffle mixes
  the agents' rows);
- generation phase: each base generates its rows in its own call, one after another. Eager `generate` frees its KV
  cache when a call returns: the largest base's phase. The captured decode step keeps every base's caches through the
  rollout: their sum, plus the largest of the other terms;
- overhead once (one process, one CUDA context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .estimate import MemoryEstimate, estimate_memory, overhead_bytes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..config import MAGRPOConfig


@dataclass(frozen=True)
class PlannedBase:
    """One base as the planner sees it: the model it names, whether it is 4-bit, its dtype (None: the team's) and
    its agents' indices."""

    model: str | None
    load_in_4bit: bool
    dtype: str | None
    agents: tuple[int, ...]


def planned_bases(config: MAGRPOConfig, model_name_or_path: str | None, load_in_4bit: bool) -> list[PlannedBase]:
    """The team's bases from its `agents` (an agent without `model` on `model_name_or_path`, the default model when
    None), the first agent's first, each agent's own `load_in_4bit` and `dtype` in place of the team's."""
    from ..team.bases import model_key
    from ..team.default_model import DEFAULT_MODEL_ID

    groups: dict[str, list[int]] = {}
    first: dict[str, dict] = {}
    for index, agent in enumerate(config.agents):
        name = agent.get("model", model_name_or_path)
        key = model_key(name or DEFAULT_MODEL_ID)
        groups.setdefault(key, []).append(index)
        first.setdefault(key, {**agent, "model": name})
    return [
        PlannedBase(
            model=first[key]["model"],
            load_in_4bit=first[key].get("load_in_4bit", load_in_4bit),
            dtype=None if first[key].get("dtype") in (None, "auto") else first[key]["dtype"],
            agents=tuple(agents),
        )
        for key, agents in groups.items()
    ]


def estimate_team_memory(
    config: MAGRPOConfig,
    model_config: PretrainedConfig | None = None,
    *,
    model_name_or_path: str | None = None,
    load_in_4bit: bool = False,
    device: str = "cuda",
    model_configs: dict[str, PretrainedConfig] | None = None,
    **kwargs: Any,
) -> MemoryEstimate:
    """`estimate_memory` for a team on one base or several: one base is `estimate_memory` itself; several are each
    estimated alone (their own config.json, read from the Hub, its cache or a local folder unless `model_configs`
    maps the model name to it) and summed (this module's docstring). The estimate's `bases` lists each base's own."""
    bases = planned_bases(config, model_name_or_path, load_in_4bit)
    if len(bases) == 1:
        return estimate_memory(
            config,
            model_config,
            model_name_or_path=model_name_or_path,
            load_in_4bit=load_in_4bit,
            device=device,
            **kwargs,
        )
    if config.use_vllm:
        raise ValueError(
            f"`use_vllm=True` with agents on {len(bases)} base models: a team's vLLM engine serves one base. Plan "
            "without vLLM (each base generates with transformers)."
        )
    from ..team.bases import model_key

    configs = {model_key(name): value for name, value in (model_configs or {}).items()}
    parts = []
    for index, base in enumerate(bases):
        given = model_config if index == 0 and base.model == model_name_or_path else None
        if given is None and base.model is not None:
            given = configs.get(model_key(base.model))
        parts.append(
            estimate_memory(
                config,
                given,
                model_name_or_path=base.model,
                load_in_4bit=base.load_in_4bit,
                device=device,
                model_dtype=base.dtype,
                agents=list(base.agents),
                **kwargs,
            )
        )
    return combined(config, bases, parts, device)


def combined(
    config: MAGRPOConfig, bases: list[PlannedBase], parts: list[MemoryEstimate], device: str
) -> MemoryEstimate:
    """The team's estimate from its bases' (`parts`), summed as this module's docstring says."""
    captured = any(part.details.get("captured decode") for part in parts)
    largest = max(parts, key=lambda part: part.generation_phase)
    if captured:  # every base's static caches are held through the rollout
        kv_cache = sum(part.kv_cache for part in parts)
        prefill = max(part.prefill_working_set for part in parts)
        logits = max(part.generation_logits for part in parts)
        routed = 0
    else:
        kv_cache, routed = largest.kv_cache, largest.routed_lora_weights
        prefill, logits = largest.prefill_working_set, largest.generation_logits
    estimate = MemoryEstimate(
        device=device,
        base_weights=sum(part.base_weights for part in parts),
        adapters=sum(part.adapters for part in parts),
        optimizer_states=sum(part.optimizer_states for part in parts),
        gradients=sum(part.gradients for part in parts),
        saved_activations=sum(part.saved_activations for part in parts),
        log_prob_head=max(part.log_prob_head for part in parts),
        backward_working_set=max(part.backward_working_set for part in parts),
        kv_cache=kv_cache,
        routed_lora_weights=routed,
        prefill_working_set=prefill,
        generation_logits=logits,
        overhead=0,
        captured_decode=sum(part.captured_decode for part in parts),
        details={
            "bases": len(parts),
            "adapters": sum(part.details["adapters"] for part in parts),
            "captured decode": captured,
        },
        bases=[(_base_label(config, base), part) for base, part in zip(bases, parts)],
    )
    estimate.overhead = overhead_bytes(device, max(estimate.training_phase, estimate.generation_phase))
    return estimate


def _base_label(config: MAGRPOConfig, base: PlannedBase) -> str:
    """A base as the table names it: its model, precision and agents."""
    from ..team.default_model import DEFAULT_MODEL_ID

    agents = ", ".join(config.agent_names[i] for i in base.agents)
    precision = "4-bit" if base.load_in_4bit else (base.dtype or "the team's dtype")
    return f"{base.model or DEFAULT_MODEL_ID} ({precision}; {agents})"
