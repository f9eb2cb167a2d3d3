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

With `vllm_enable_sleep_mode=True` the engine sleeps at level 1 between generations (weights offloaded to CPU memory,
KV cache freed) where TRL's sleeps at level 2 (weights discarded, merged ones re-sent): the team engine never re-sends
the base, so it must keep it.

`SavedTeamEngine` serves a team saved by `save_model` (its adapter folders as they are) for `load_team(...).run`.
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

from .memory.geometry import VLLM_MAX_NUM_BATCHED_TOKENS, vllm_max_num_seqs
from .routing import BASE

SERVER_MODE_REASON = (
    "`vllm_mode='server'` is not supported: TRL's `trl vllm-serve` server receives merged full weights, one policy, "
    "while each agent needs its own adapter in the same batch. Use `vllm_mode='colocate'`, which serves every agent's "
    "adapter as a LoRA from one engine in the trainer's process."
)


# The values vLLM accepts for `max_lora_rank` (vllm.config.lora.MaxLoRARanks, 0.22-0.31).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_settings(num_adapters: int, lora_rank: int, dtype: torch.dtype | str) -> dict[str, Any]:
    """The `vllm.LLM` arguments that serve `num_adapters` LoRA adapters of rank at most `lora_rank` in one batch, in
    `dtype` (the model's: vLLM would otherwise pick its own). `max_lora_rank` is the smallest value vLLM accepts
    that holds `lora_rank` (a rank-4 adapter is served in rank-8 slots)."""
    supported = [rank for rank in VLLM_MAX_LORA_RANKS if rank >= lora_rank]
    if not supported:
        raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]}; `lora_r` is {lora_rank}.")
    return {
        "enable_lora": True,
        "max_loras": num_adapters,
        "max_lora_rank": supported[0],
        "dtype": str(dtype).removeprefix("torch."),
    }


def keep_base_when_sleeping(llm: Any) -> Any:
    """Make `llm.sleep` sleep at level 1 whatever level it is asked for. TRL's colocate engine sleeps at level 2,
    which discards the weights because TRL re-sends merged weights at every wake-up; the team engine is sent adapters
    only, so its base must survive the sleep: level 1 offloads the weights to CPU memory and frees the KV cache."""
    sleep = llm.sleep

    def sleep_keeping_the_base(level: int = 1, **kwargs: Any) -> None:
        sleep(level=1, **kwargs)

    llm.sleep = sleep_keeping_the_base
    return llm


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
        team_rows: the rows of the team's largest generation call. TRL sizes vLLM's `max_num_seqs` for one policy's
            prompts; a team call holds every agent's rows, so the engine runs at least this many at once.
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
        team_rows: int = 0,
        **settings: Any,
    ):
        if settings.get("mode", "colocate") != "colocate":
            raise ValueError(SERVER_MODE_REASON)
        if "max_num_seqs" in settings:
            team_rows = min(team_rows, VLLM_MAX_NUM_BATCHED_TOKENS)  # vLLM refuses more sequences than tokens a step
            settings["max_num_seqs"] = max(settings["max_num_seqs"] or 0, team_rows) or None
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
        """TRL's colocate engine, built with LoRA serving for every adapter, in the model's dtype, and sleeping at
        level 1 (`keep_base_when_sleeping`)."""
        from vllm import LLM

        if self.enable_sleep_mode:
            check_sleep_mode_available()
        settings = lora_engine_settings(len(self.adapter_names), self.lora_rank, self.model.dtype)

        def team_llm(**kwargs: Any) -> Any:
            return keep_base_when_sleeping(LLM(**kwargs, **settings))

        with mock.patch.object(vllm_generation, "LLM", team_llm):
            super()._init_vllm()

    def sync_weights(self) -> None:
        """Send the trained adapters (all adapters on the first call) to the engine as a new version, unless the
        engine serves this step's already. A sleeping engine's weights are woken first: TRL's `generate` calls this
        to wake it."""
        from vllm.lora.request import LoRARequest

        if self.enable_sleep_mode and self._llm_weights_sleeping:
            empty_cache()
            self.llm.wake_up(tags=["weights"])
            self._llm_weights_sleeping = False
        if self.lora_requests and self.version == self.current_step():
            return
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


def check_sleep_mode_available() -> None:
    """Raise, saying what to do, where vLLM has no sleep mode (it has one on CUDA, ROCm and XPU, not on the CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise ValueError(
            f"`vllm_enable_sleep_mode=True`: vLLM has no sleep mode on this device ({current_platform.device_type}); "
            "it has one on CUDA, ROCm and XPU GPUs. Set `vllm_enable_sleep_mode=False`."
        )


class SavedTeamEngine:
    """A vLLM engine serving a team saved by `save_model`: the base model once, each adapter folder as a LoRA.

    Args:
        base_model: the base model's Hub id or local folder.
        adapter_folders: adapter name -> its PEFT folder.
        lora_rank: the largest rank of the adapters.
        dtype: the dtype to serve in (the trainer's model dtype keeps replays close to training).
        **settings: further `vllm.LLM` arguments (`gpu_memory_utilization`, `max_model_len`, `quantization`, ...).
    """

    def __init__(
        self,
        base_model: str,
        adapter_folders: dict[str, str | Path],
        lora_rank: int,
        dtype: torch.dtype | str,
        **settings: Any,
    ):
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        lora = lora_engine_settings(len(adapter_folders), lora_rank, dtype)
        self.llm = LLM(model=base_model, **lora, **{k: v for k, v in settings.items() if v is not None})
        self.lora_requests = {
            name: LoRARequest(name, index, str(folder))
            for index, (name, folder) in enumerate(adapter_folders.items(), start=1)
        }

    def generate(
        self,
        prompt_ids: list[list[int]],
        adapters: list[str],
        max_new_tokens: int,
        do_sample: bool,
        stop_token_ids: list[int],
    ) -> list[list[int]]:
        """Completion token ids of each prompt, row `i` served by adapter `adapters[i]`: greedy, or sampled at
        temperature 1 with `do_sample` (as transformers' `generate` defaults), ending at a stop token (kept)."""
        from vllm import SamplingParams

        params = SamplingParams(
            max_tokens=max_new_tokens, temperature=1.0 if do_sample else 0.0, stop_token_ids=stop_token_ids
        )
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            params,
            lora_request=[self.lora_requests[adapter] for adapter in adapters],
            use_tqdm=False,
        )
        return [list(output.outputs[0].token_ids) for output in outputs]

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if self.llm is not None:
            self.llm = None
            cleanup_dist_env_and_memory()


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
