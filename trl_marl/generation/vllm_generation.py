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

TRL builds its engine inside `_init_vllm` and gives no seam for the team's settings, so `TeamVLLMGeneration` overrides
`_init_vllm` and builds the engine itself (a mirror of TRL 1.16's colocate branch), as a `vllm_serving.TeamLLM`: vLLM's
`LLM` with level-1 sleep and a `generate` that serves each row of TRL's call with its LoRA and seed.

The engine's settings, the checks that refuse what vLLM cannot serve, and `SavedTeamEngine` (a saved team for
`load_team(...).run`) are in `vllm_serving.py`.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from trl.generation.vllm_generation import VLLMGeneration, empty_cache
from trl.trainer.utils import ensure_master_addr_port

from .routing import BASE
from .vllm_limits import SERVER_MODE_REASON, VLLM_MAX_NUM_BATCHED_TOKENS
from .vllm_serving import (
    bitsandbytes_quantization,
    check_quantization_served,
    check_sharding_served,
    check_sleep_mode_available,
    check_vllm_installed,
    register_open_engine,
    sampling_seed,
    shut_down_engine,
    start_team_llm,
    unregister_open_engine,
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
        if settings.get("tensor_parallel_size", 1) != 1:
            raise ValueError(
                "`vllm_tensor_parallel_size` must be 1 with `use_vllm`: TRL's tensor-parallel generation gathers the "
                "prompts of several processes into one call, while each process's rows carry their own adapters."
            )
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
        """TRL's colocate engine, built here with LoRA serving for every adapter, in the model's dtype, as a
        `TeamLLM` (level-1 sleep, each row's LoRA and seed).

        An override, not a call of TRL's: `VLLMGeneration._init_vllm` builds vLLM's `LLM` itself and gives no seam to
        add the team's settings. It mirrors TRL 1.16's colocate branch of `_init_vllm` (the environment vLLM's
        external launcher reads, the bitsandbytes detection, the `LLM` arguments, the first sleep, the barrier):
        re-read it when the TRL pin moves. Server mode is refused in `__init__`, tensor parallelism by the config and
        `__init__` (so TRL's tensor-parallel subgroups are not needed)."""
        check_vllm_installed()
        if self.enable_sleep_mode:
            check_sleep_mode_available()
        quantization = bitsandbytes_quantization(self.model)
        check_quantization_served(quantization == "bitsandbytes" or getattr(self.model, "is_loaded_in_4bit", False))
        accelerator = self.accelerator
        # vLLM's external launcher reads the process's place from the environment, as TRL sets it
        os.environ["RANK"] = str(accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
        ensure_master_addr_port()
        self.llm = start_team_llm(
            len(self.adapter_names),
            self.lora_rank,
            self.model.dtype,
            "a different `vllm_gpu_memory_utilization` in the trainer's config",
            model=self.model.name_or_path,
            tensor_parallel_size=self.tensor_parallel_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length,
            max_num_seqs=self.max_num_seqs,
            enable_sleep_mode=self.enable_sleep_mode,
            model_impl=self.model_impl,
            distributed_executor_backend="external_launcher",
            seed=accelerator.process_index // self.tensor_parallel_size,  # TRL's (the size is 1)
            max_num_batched_tokens=VLLM_MAX_NUM_BATCHED_TOKENS,  # TRL's 4096
            logprobs_mode="processed_logprobs",  # temperature and the other logit settings apply to the log-probs
            quantization=quantization,
            trust_remote_code=self.trust_remote_code,
        )
        if self.enable_sleep_mode:
            self.llm.sleep()  # level 1 (TRL's level 2 would discard the base, which is never re-sent)
        self._llm_weights_sleeping = self.enable_sleep_mode  # the next `sync_weights` wakes them
        # TRL's: vLLM loads the weights in each process; the processes wait for each other before training on
        accelerator.wait_for_everyone()
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
                "adapters (`TeamGeneration.route`) before generating."
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
        with self.llm.serving(self.row_lora_requests(len(prompts)), self.request_seeds(len(prompts))):
            return super().generate(prompts, images, num_generations, profiler)  # its `llm.generate` serves the rows

    @contextlib.contextmanager
    def awake(self) -> Iterator[None]:
        """The engine ready for requests made outside `generate` (the episode server's, `episode_runner.py`): started,
        this step's adapters served, weights and KV cache awake; asleep again afterwards, as after `generate`
        (`vllm_enable_sleep_mode`)."""
        self.sync_weights()  # starts a closed engine, wakes the weights
        if self.enable_sleep_mode:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            yield
        finally:
            if self.enable_sleep_mode:
                self.llm.sleep()
                self._llm_weights_sleeping = True

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


class SamplingCorrection:
    """vLLM's log-probs of every generated row, carried to TRL's importance-sampling correction: `record` keeps them
    at generation, `outputs` turns them into TRL's `sampling_per_token_logps` and `importance_sampling_ratio` (and
    TRL's sampling metrics) when the rows reach the loss.

    Args:
        mode, clip_min, clip_max: TRL's `vllm_importance_sampling_mode` and its clipping bounds.
    """

    def __init__(self, mode: str, clip_min: float | None, clip_max: float | None):
        self.mode, self.clip_min, self.clip_max = mode, clip_min, clip_max
        self.sampling_logps: dict[tuple, list[float]] = {}

    def record(self, agent_index, prompt_ids, completion_ids, logprobs) -> None:
        """Keep vLLM's log-prob of each generated token, by (agent, prompt, completion): equal keys were sampled by the
        same adapter version from the same prompt, so they have equal log-probs. A token vLLM could not score (None) is
        kept as NaN."""
        for agent, prompt, completion, logps in zip(agent_index, prompt_ids, completion_ids, logprobs):
            logps = [math.nan if logp is None else logp for logp in logps]
            self.sampling_logps[(agent, tuple(prompt), tuple(completion))] = logps

    def outputs(self, samples: list, output: dict, metrics: dict, gather: Callable) -> dict:
        """`sampling_per_token_logps` and `importance_sampling_ratio` of the rows (`samples`, padded in `output`), as
        TRL's loss reads them; TRL's sampling metrics into `metrics` (gathered over processes with `gather`)."""
        width = output["completion_ids"].size(1)
        rows = [self.sampling_logps[(s.agent, tuple(s.prompt_ids), tuple(s.completion_ids))] for s in samples]
        self.sampling_logps.clear()
        sampling = torch.tensor(
            [logps + [0.0] * (width - len(logps)) for logps in rows], device=output["completion_ids"].device
        )
        mask = output["completion_mask"]
        if (
            output.get("tool_mask") is not None
        ):  # tool results were never sampled: out of the ratio, as TRL leaves them
            mask = mask * output["tool_mask"]
        old = output["old_per_token_logps"]
        ratio = importance_sampling_ratio(old, sampling, mask, self.mode, self.clip_min, self.clip_max)
        delta = torch.abs(old - sampling)[mask.bool()]
        delta = delta[~torch.isnan(delta)]
        flat = ratio.flatten() if ratio.size(1) == 1 else ratio[mask.bool()]
        for name, values in (("sampling_logp_difference", delta), ("importance_sampling_ratio", flat)):
            values = values if values.numel() else torch.zeros(1, device=values.device)
            if name == "importance_sampling_ratio":
                metrics[f"sampling/{name}/min"].append(gather(values.min()).min().item())
            metrics[f"sampling/{name}/mean"].append(gather(values.mean()).mean().item())
            metrics[f"sampling/{name}/max"].append(gather(values.max()).max().item())
        return {"sampling_per_token_logps": sampling, "importance_sampling_ratio": ratio}
