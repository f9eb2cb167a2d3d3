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
  rows come back in order. Each row also gets its own sampling seed (`request_seeds`), from the run's `seed`, the step,
  the call within the step, the process and the row: sampling is the same in every run with one seed, and a run
  resumed from a checkpoint samples what the uninterrupted run sampled.

The trainer closes the engine when `train()` returns, so its memory is free for what follows (`load_team(...,
use_vllm=True)`, another trainer); a later `evaluate()` or `train()` starts it again.

With `vllm_enable_sleep_mode=True` the engine sleeps at level 1 between generations (weights offloaded to CPU memory,
KV cache freed) where TRL's sleeps at level 2 (weights discarded, merged ones re-sent): the team engine never re-sends
the base, so it must keep it.

The engine's settings, the checks that refuse what vLLM cannot serve, and `SavedTeamEngine` (a saved team for
`load_team(...).run`) are in `vllm_serving.py`.
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
from trl.generation.vllm_generation import VLLMGeneration, empty_cache
from trl.trainer import grpo_trainer

from .config import SERVER_MODE_REASON
from .memory.geometry import VLLM_MAX_NUM_BATCHED_TOKENS, vllm_max_num_seqs
from .routing import BASE
from .vllm_serving import (
    check_quantization_served,
    check_sharding_served,
    check_sleep_mode_available,
    check_vllm_installed,
    keep_base_when_sleeping,
    keep_process_rng,
    lora_engine_settings,
    naming_the_memory_setting,
    register_open_engine,
    sampling_seed,
    shut_down_engine,
    unregister_open_engine,
    with_seeds,
)


def _shared_memory_dir() -> str | None:
    """A RAM-backed folder for adapter versions where the system has one with room (Linux `/dev/shm`, at least 1 GiB
    free: containers often give it 64 MiB), else the default temp."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and shutil.disk_usage(shm).free >= 2**30 else None


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
        team_rows: the rows of the team's largest generation call. TRL sizes vLLM's `max_num_seqs` for one policy's
            prompts; a team call holds every agent's rows, so the engine runs at least this many at once.
        seed: the run's seed (the trainer's `seed`), from which each request's sampling seed is made
            (`request_seeds`); a `seed` in `generation_kwargs` takes its place.
        **settings: `VLLMGeneration`'s own arguments (accelerator, processing class, vLLM and sampling settings).
    """

    close_call = "trainer.vllm_generation.close()"

    def __init__(
        self,
        model: Any,
        row_adapters: Callable[[], list[str] | None],
        adapter_names: list[str],
        current_step: Callable[[], int],
        trained_adapters: list[str],
        lora_rank: int,
        team_rows: int = 0,
        seed: int = 0,
        **settings: Any,
    ):
        if settings.get("mode", "colocate") != "colocate":
            raise ValueError(SERVER_MODE_REASON)
        check_sharding_served(settings.get("accelerator"))
        if "max_num_seqs" in settings:
            team_rows = min(team_rows, VLLM_MAX_NUM_BATCHED_TOKENS)  # vLLM refuses more sequences than tokens a step
            settings["max_num_seqs"] = max(settings["max_num_seqs"] or 0, team_rows) or None
        self.row_adapters = row_adapters
        self.adapter_names = list(adapter_names)
        self.current_step = current_step
        self.trained_adapters = list(trained_adapters)
        self.lora_rank = lora_rank
        self.seed = seed
        self._call: tuple = (None, -1)  # (mode, step) of the latest generation call, and its index within them
        self.version: int | None = None  # the step of the trained adapters the engine serves; None before a sync
        self.lora_requests: dict[str, Any] = {}  # adapter name -> the LoRARequest of its served version
        self._next_lora_id = 1
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="trl_marl-vllm-adapters-", dir=_shared_memory_dir()))
        super().__init__(model=model, **settings)

    def _init_vllm(self) -> None:
        """TRL's colocate engine, built with LoRA serving for every adapter, in the model's dtype, and sleeping at
        level 1 (`keep_base_when_sleeping`)."""
        check_vllm_installed()
        from vllm import LLM

        if self.enable_sleep_mode:
            check_sleep_mode_available()
        check_quantization_served(getattr(self.model, "is_loaded_in_4bit", False))
        settings = lora_engine_settings(len(self.adapter_names), self.lora_rank, self.model.dtype)

        def team_llm(**kwargs: Any) -> Any:
            how_to_set = "a different `vllm_gpu_memory_utilization` in the trainer's config"
            with naming_the_memory_setting(kwargs.get("gpu_memory_utilization"), how_to_set), keep_process_rng():
                return keep_base_when_sleeping(LLM(**kwargs, **settings))

        with mock.patch.object(vllm_generation, "LLM", team_llm):
            super()._init_vllm()
        register_open_engine(self)

    def _start_again(self) -> None:
        """Start the engine again after `close` (the trainer closes it when `train()` returns): every adapter is
        sent at the next sync."""
        if getattr(self, "llm", None) is not None:
            return
        self._adapter_dir = Path(tempfile.mkdtemp(prefix="trl_marl-vllm-adapters-", dir=_shared_memory_dir()))
        self.lora_requests = {}
        self.version = None
        self._init_vllm()

    def sync_weights(self) -> None:
        """Send the trained adapters (all adapters on the first call) to the engine as a new version, unless the
        engine serves this step's already. A sleeping engine's weights are woken first: TRL's `generate` calls this
        to wake it."""
        from vllm.lora.request import LoRARequest

        self._start_again()
        if self.enable_sleep_mode and self._llm_weights_sleeping:
            empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        step = self.current_step()
        if self.lora_requests and self.version == step:
            return
        for adapter in self.adapter_names if not self.lora_requests else self.trained_adapters:
            folder = self._adapter_dir / f"{adapter}@step{step}-{self._next_lora_id}"
            self.model.save_pretrained(folder, selected_adapters=[adapter])
            old = self.lora_requests.get(adapter)
            self.lora_requests[adapter] = LoRARequest(
                folder.name, self._next_lora_id, str(self._adapter_path(folder, adapter))
            )
            self._next_lora_id += 1  # a new id per version: vLLM caches adapters by id
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(self._adapter_dir / old.lora_name, ignore_errors=True)
        self.version = step  # only once every adapter of this version is served

    def invalidate(self) -> None:
        """Adapters were loaded into the model outside an optimizer step (a checkpoint, the best model): the next
        `sync_weights` sends the trained adapters as a new version, whatever the step."""
        self.version = None

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

    def request_seeds(self, num_rows: int) -> list[int]:
        """The sampling seed of each row of a new generation call: made from the run's seed, the mode (`train` or
        `eval`) and optimizer step, the index of the call among this mode's calls at this step (a multi-turn tree or
        AT-GRPO's phases make several), the process and the row. Everything in it is restored when a run resumes from
        a checkpoint, so the resumed run gives its calls the seeds the uninterrupted run gave them."""
        key = ("train" if self.model.training else "eval", self.current_step())
        self._call = (key, self._call[1] + 1 if self._call[0] == key else 0)
        base = self.generation_kwargs.get("seed")
        base = self.seed if base is None else base
        process = self.accelerator.process_index
        return [sampling_seed(base, *key, self._call[1], process, row) for row in range(num_rows)]

    def generate(self, prompts, images, num_generations, profiler=None):
        """TRL's colocated generation, each row served with its adapter's LoRA and sampled with its own seed."""
        self._start_again()
        if (self.enable_sleep_mode and self._llm_weights_sleeping) or not self.lora_requests:
            self.sync_weights()  # wakes the weights (TRL's generate would, after the requests are built)
        requests = self.row_lora_requests(len(prompts))
        seeds = self.request_seeds(len(prompts))
        generate = self.llm.generate

        def team_generate(vllm_prompts, sampling_params, **kwargs):
            if len(vllm_prompts) != len(seeds):
                raise RuntimeError(f"vLLM got {len(vllm_prompts)} prompts for {len(seeds)} rows.")
            return generate(
                vllm_prompts, sampling_params=with_seeds(sampling_params, seeds), lora_request=requests, **kwargs
            )

        with mock.patch.object(self.llm, "generate", team_generate):
            return super().generate(prompts, images, num_generations, profiler)

    def close(self) -> None:
        """Shut the engine down, free its memory (weights, KV cache) and remove the saved adapter versions. Another
        engine can then start in this process; this one starts again at its next sync or generation."""
        unregister_open_engine(self)
        if getattr(self, "llm", None) is not None:
            self.llm = None
            shut_down_engine()
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
    def _team_vllm_backend(self, model: Any, args: Any):
        """While `GRPOTrainer.__init__` runs (with `args.use_vllm`), it builds a `TeamVLLMGeneration` where it would
        build TRL's engine."""
        self._sampling_logps: dict[tuple, list[float]] = {}
        if not args.use_vllm:
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
            team_rows=vllm_max_num_seqs(args),
            seed=args.seed,
        )
        with mock.patch.object(grpo_trainer, "VLLMGeneration", factory):
            yield

    def train(self, *args, **kwargs):
        """`GRPOTrainer.train`, then the vLLM engine is closed (also when training fails), so its memory is free for
        what follows in this process (`load_team(..., use_vllm=True)`, another trainer). A later `evaluate()` or
        `train()` starts it again."""
        try:
            return super().train(*args, **kwargs)
        finally:
            if getattr(self, "use_vllm", False) and getattr(self, "vllm_generation", None) is not None:
                self.vllm_generation.close()

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        self._serve_loaded_adapters()

    def _load_best_model(self):
        super()._load_best_model()
        self._serve_loaded_adapters()

    def _serve_loaded_adapters(self) -> None:
        """Adapters loaded from a checkpoint are not the served version of any step: the next generation sends them."""
        if getattr(self, "use_vllm", False) and getattr(self, "vllm_generation", None) is not None:
            self.vllm_generation.invalidate()
            self._last_loaded_step = -1

    @property
    def _corrects_vllm_sampling(self) -> bool:
        """Whether TRL's importance-sampling correction applies (vLLM samples, the trainer's model scores)."""
        return self.use_vllm and self.vllm_importance_sampling_correction

    def _record_sampling_logps(self, agent_index, prompt_ids, completion_ids, logprobs) -> None:
        """Keep vLLM's log-prob of each generated token, by (agent, prompt, completion), while the correction needs
        them: equal keys were sampled by the same adapter version from the same prompt, so they have equal log-probs.
        A token vLLM could not score (None) is kept as NaN."""
        if not self._corrects_vllm_sampling:
            return
        for agent, prompt, completion, logps in zip(agent_index, prompt_ids, completion_ids, logprobs):
            logps = [math.nan if logp is None else logp for logp in logps]
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
        delta = delta[~torch.isnan(delta)]
        flat = ratio.flatten() if ratio.size(1) == 1 else ratio[mask.bool()]
        gather = self.accelerator.gather
        for name, values in (("sampling_logp_difference", delta), ("importance_sampling_ratio", flat)):
            values = values if values.numel() else torch.zeros(1, device=values.device)
            if name == "importance_sampling_ratio":
                self._metrics[mode][f"sampling/{name}/min"].append(gather(values.min()).min().item())
            self._metrics[mode][f"sampling/{name}/mean"].append(gather(values.mean()).mean().item())
            self._metrics[mode][f"sampling/{name}/max"].append(gather(values.max()).max().item())
        return {"sampling_per_token_logps": sampling, "importance_sampling_ratio": ratio}
