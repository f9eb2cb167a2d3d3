"""Team rollouts through vLLM: one engine holds the base model and serves every agent's adapter as a LoRA
(docs/vllm.md).

TRL's `VLLMGeneration` merges the active adapter into the base weights and pushes them to vLLM, so its engine serves
one policy. A team needs one policy per agent in the same batch, which vLLM does natively: each prompt of a
`LLM.generate` call may carry its own `LoRARequest`. `TeamVLLMGeneration` keeps TRL's settings and generation code and
changes three things:

- the engine is built with LoRA enabled (`max_loras` = the team's adapters, `max_lora_rank` = their largest rank)
  and in the training model's dtype;
- `sync_weights` sends only the trained adapters (the base never changes), saved in PEFT format under a new name and
  id per version, so that an adapter of an earlier step can never be served; frozen adapters are loaded once;
- `generate` gives row `i` the `LoRARequest` of the adapter the router sends row `i` to (`AdapterRouter.route`), and
  rows come back in order.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from trl.generation import vllm_generation
from trl.generation.vllm_generation import VLLMGeneration
from trl.trainer import grpo_trainer

from .routing import BASE

SERVER_MODE_REASON = (
    "`vllm_mode='server'` is not supported: TRL's `trl vllm-serve` server receives merged full weights, one policy, "
    "while each agent needs its own adapter in the same batch. Use `vllm_mode='colocate'`, which serves every agent's "
    "adapter as a LoRA from one engine in the trainer's process."
)


def _shared_memory_dir() -> str | None:
    """A RAM-backed folder for adapter versions where the system has one (Linux `/dev/shm`), else the default temp."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


class TeamVLLMGeneration(VLLMGeneration):
    """TRL's colocated vLLM generation, serving one LoRA per adapter of the team.

    Args:
        model: the trainer's PEFT model (its base is what vLLM loads, from `model.name_or_path`).
        row_adapters: gives the adapter of each row the router routes (`AdapterRouter.row_adapters`, `BASE` for the
            base model alone); `generate` serves row `i` with the `i`-th.
        adapter_names: every adapter of the team.
        current_step: gives the optimizer step the adapters are at (the trainer's `state.global_step`): the version
            a sync sends.
        trained_adapters: the adapters that change with training: each `sync_weights` sends a new version of them.
        lora_rank: the largest LoRA rank of the team's adapters (vLLM's `max_lora_rank`).
        **settings: `VLLMGeneration`'s own arguments (accelerator, processing class, vLLM and sampling settings).
    """

    def __init__(
        self,
        model: Any,
        row_adapters: Callable[[], list[str] | None],
        adapter_names: list[str],
        current_step: Callable[[], int],
        trained_adapters: list[str],
        lora_rank: int,
        **settings: Any,
    ):
        if settings.get("mode", "colocate") != "colocate":
            raise ValueError(SERVER_MODE_REASON)
        self.row_adapters = row_adapters
        self.adapter_names = list(adapter_names)
        self.current_step = current_step
        self.trained_adapters = list(trained_adapters)
        self.lora_rank = lora_rank
        self.version: int | None = None  # the step of the trained adapters the engine serves; None before a sync
        self.lora_requests: dict[str, Any] = {}  # adapter name -> the LoRARequest of its served version
        self._next_lora_id = 1
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="trl_marl-vllm-adapters-", dir=_shared_memory_dir()))
        super().__init__(model=model, **settings)

    def _init_vllm(self) -> None:
        """TRL's colocate engine, built with LoRA serving for every adapter and in the model's dtype."""
        from vllm import LLM

        with_lora = functools.partial(
            LLM,
            enable_lora=True,
            max_loras=len(self.adapter_names),
            max_lora_rank=self.lora_rank,
            dtype=str(self.model.dtype).removeprefix("torch."),
        )
        with mock.patch.object(vllm_generation, "LLM", with_lora):
            super()._init_vllm()

    def sync_weights(self) -> None:
        """Send the trained adapters (all adapters on the first call) to the engine as a new version."""
        from vllm.lora.request import LoRARequest

        self.version = self.current_step()
        for adapter in self.adapter_names if not self.lora_requests else self.trained_adapters:
            folder = self._adapter_dir / f"{adapter}@step{self.version}-{self._next_lora_id}"
            self.model.save_pretrained(folder, selected_adapters=[adapter])
            old = self.lora_requests.get(adapter)
            self.lora_requests[adapter] = LoRARequest(
                folder.name, self._next_lora_id, str(self._adapter_path(folder, adapter))
            )
            self._next_lora_id += 1  # a new id per version: vLLM caches adapters by id
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(self._adapter_dir / old.lora_name, ignore_errors=True)

    @staticmethod
    def _adapter_path(folder: Path, adapter: str) -> Path:
        """Where PEFT's `save_pretrained` put `adapter` (the `default` adapter in the folder itself)."""
        return folder if adapter == "default" else folder / adapter

    def row_lora_requests(self, num_rows: int) -> list[Any]:
        """The LoRA request of each row the router routes (None for a row routed to the base model)."""
        row_adapters = self.row_adapters()
        if row_adapters is None or len(row_adapters) != num_rows:
            raise RuntimeError(
                f"vLLM got {num_rows} prompts but the router routes "
                f"{'no rows' if row_adapters is None else f'{len(row_adapters)} rows'}: route the rows to their "
                "adapters (`TeamTrainer._route_rows`) before generating."
            )
        return [None if adapter == BASE else self.lora_requests[adapter] for adapter in row_adapters]

    def generate(self, prompts, images, num_generations, profiler=None):
        """TRL's colocated generation, each row served with its adapter's LoRA."""
        requests = self.row_lora_requests(len(prompts))
        generate = self.llm.generate
        with mock.patch.object(self.llm, "generate", functools.partial(generate, lora_request=requests)):
            return super().generate(prompts, images, num_generations, profiler)

    def close(self) -> None:
        """Shut the engine down, free its memory (weights, KV cache) and remove the saved adapter versions. A later
        trainer can then start an engine of its own in this process."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if getattr(self, "llm", None) is not None:
            self.llm = None
            cleanup_dist_env_and_memory()
        shutil.rmtree(self._adapter_dir, ignore_errors=True)


def importance_sampling_ratio(
    old_logps: torch.Tensor,
    sampling_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> torch.Tensor:
    """TRL's correction for the gap between the sampler (vLLM) and the trainer: exp(trainer − sampler log-probs) per
    token (`token_*`, `(B, T)`) or per sequence (`sequence_*`, summed over the completion, `(B, 1)`), then truncated to
    `[clip_min, clip_max]` (`*_truncate`) or zeroed outside it (`*_mask`). Tokens vLLM could not score (NaN) get a
    ratio of 1."""
    difference = torch.nan_to_num((old_logps - sampling_logps) * mask, nan=0.0)
    if mode.startswith("sequence_"):
        difference = difference.sum(dim=-1, keepdim=True)
    ratio = torch.exp(difference)
    if mode.endswith("_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


class TeamVLLMMixin:
    """What `TeamTrainer` adds for `use_vllm=True`: the team engine in place of TRL's, and the sampler's log-probs of
    every row carried to TRL's importance-sampling correction."""

    @contextlib.contextmanager
    def _team_vllm_backend(self, model: Any, enabled: bool):
        """While `GRPOTrainer.__init__` runs (with `enabled`, i.e. `use_vllm`), it builds a `TeamVLLMGeneration` where
        it would build TRL's engine."""
        self._sampling_logps: dict[tuple, list[float]] = {}
        if not enabled:
            yield
            return
        ranks = [config.r for name, config in model.peft_config.items() if name in self.adapter_names]
        factory = functools.partial(
            TeamVLLMGeneration,
            row_adapters=lambda: self.router.row_adapters,
            adapter_names=self.adapter_names,
            current_step=lambda: self.state.global_step,
            trained_adapters=self.trained_adapters,
            lora_rank=max(ranks),
        )
        with mock.patch.object(grpo_trainer, "VLLMGeneration", factory):
            yield

    @property
    def _corrects_vllm_sampling(self) -> bool:
        """Whether TRL's importance-sampling correction applies (vLLM samples, the trainer's model scores)."""
        return self.use_vllm and self.vllm_importance_sampling_correction

    def _record_sampling_logps(self, agent_index, prompt_ids, completion_ids, logprobs) -> None:
        """Keep vLLM's log-prob of each generated token, by (agent, prompt, completion): equal keys were sampled by the
        same adapter version from the same prompt, so they have equal log-probs."""
        for agent, prompt, completion, logps in zip(agent_index, prompt_ids, completion_ids, logprobs):
            self._sampling_logps[(agent, tuple(prompt), tuple(completion))] = logps

    def _importance_sampling_outputs(self, samples: list, output: dict, mode: str) -> dict:
        """`sampling_per_token_logps` and `importance_sampling_ratio` of the rows, as TRL's loss reads them, and TRL's
        sampling metrics."""
        if not self._corrects_vllm_sampling:
            return {}
        width = output["completion_ids"].size(1)
        rows = [self._sampling_logps[(s.agent, tuple(s.prompt_ids), tuple(s.completion_ids))] for s in samples]
        self._sampling_logps.clear()
        sampling = torch.tensor(
            [logps + [0.0] * (width - len(logps)) for logps in rows], device=output["completion_ids"].device
        )
        mask = output["completion_mask"]
        old = output["old_per_token_logps"]
        ratio = importance_sampling_ratio(
            old,
            sampling,
            mask,
            self.vllm_importance_sampling_mode,
            self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max,
        )
        delta = torch.abs(old - sampling)[mask.bool()]
        flat = ratio.flatten() if ratio.size(1) == 1 else ratio[mask.bool()]
        gather = self.accelerator.gather
        for name, values in (("sampling_logp_difference", delta), ("importance_sampling_ratio", flat)):
            values = values if values.numel() else torch.zeros(1, device=values.device)
            if name == "importance_sampling_ratio":
                self._metrics[mode][f"sampling/{name}/min"].append(gather(values.min()).min().item())
            self._metrics[mode][f"sampling/{name}/mean"].append(gather(values.mean()).mean().item())
            self._metrics[mode][f"sampling/{name}/max"].append(gather(values.max()).max().item())
        return {"sampling_per_token_logps": sampling, "importance_sampling_ratio": ratio}
