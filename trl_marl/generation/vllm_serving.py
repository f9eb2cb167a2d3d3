"""Building and shutting down vLLM engines that serve a team: the LoRA settings of an engine, the checks that refuse
what vLLM cannot serve (with what to do instead), each request's own sampling seed, `TeamLLM` (vLLM's `LLM` with
level-1 sleep and each row's LoRA and seed), the start that names what to change when vLLM cannot start
(`start_team_llm`), and `SavedTeamEngine`, which serves a team saved by `save_model` for
`load_team(..., use_vllm=True)`. The trainer's engine is `vllm_generation.TeamVLLMGeneration`."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import random
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from trl.generation.vllm_generation import empty_cache

from .vllm_limits import vllm_lora_rank


def lora_engine_settings(num_adapters: int, lora_rank: int, dtype: torch.dtype | str) -> dict[str, Any]:
    """The `vllm.LLM` arguments that serve `num_adapters` LoRA adapters of rank at most `lora_rank` in one batch, in
    `dtype` (the model's: vLLM would otherwise pick its own). `max_lora_rank` is the smallest value vLLM accepts
    that holds `lora_rank` (`vllm_limits.vllm_lora_rank`: a rank-4 adapter is served in rank-8 slots)."""
    return {
        "enable_lora": True,
        "max_loras": num_adapters,
        "max_lora_rank": vllm_lora_rank(lora_rank),
        "dtype": str(dtype).removeprefix("torch."),
    }


def sampling_seed(*keys: Any) -> int:
    """The sampling seed of one vLLM request, from what identifies it (the run's seed, the step, the call, the process,
    the row): the same keys give the same seed in every run, process and Python (SHA-256 of their `repr`, not Python's
    salted `hash`), different keys unrelated seeds. 63 bits, so it fits every integer type a generator takes."""
    digest = hashlib.sha256(repr(keys).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def with_seeds(sampling_params: Any, seeds: list[int]) -> list[Any]:
    """One copy of vLLM's `SamplingParams` per request, each with its own `seed` (`LLM.generate` takes a list, one per
    prompt). A seeded request samples from its own generator, whatever else is in the batch or ran before it."""
    rows = []
    for seed in seeds:
        params = sampling_params.clone()
        params.seed = seed
        rows.append(params)
    return rows


@contextlib.contextmanager
def keep_process_rng() -> Iterator[None]:
    """Leave the process's random generators (Python's, NumPy's, torch's CPU one and those of initialised CUDA
    devices) as they were. vLLM seeds them all when its engine starts in this process (TRL's colocate engine with its
    process index), which would replace the trainer's `seed` and make a restarted engine reset them mid-run."""
    python, numpy_state = random.getstate(), np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy_state)


class TeamLLM:
    """vLLM's `LLM` serving a team. It holds the engine (`vllm_llm`) and answers every attribute but its own with the
    engine's; what it changes:

    - `sleep` sleeps at level 1 whatever level it is asked for. TRL's colocate engine sleeps at level 2, which
      discards the weights because TRL re-sends merged weights at every wake-up; the team engine is sent adapters only,
      so its base must survive the sleep: level 1 offloads the weights to CPU memory and frees the KV cache.
    - `generate`, inside `serving(lora_requests, seeds)`, serves row `i` of the call with the `i`-th LoRA request and
      samples it with the `i`-th seed (`with_seeds`): TRL's `generate` calls the engine with its prompts and one
      `SamplingParams`, and the team's rows are set around that call. Outside `serving` it is vLLM's `generate`.
    """

    def __init__(self, vllm_llm: Any):
        self.vllm_llm = vllm_llm
        self._rows: tuple[list[Any], list[int]] | None = None  # the LoRA requests and seeds of the call being served

    def __getattr__(self, name: str) -> Any:
        vllm_llm = self.__dict__.get("vllm_llm")  # not `self.vllm_llm`: unset while copied or unpickled
        if vllm_llm is None:
            raise AttributeError(name)
        return getattr(vllm_llm, name)

    def sleep(self, level: int = 1, **kwargs: Any) -> None:
        """vLLM's `sleep` at level 1, whatever `level` is asked for (TRL asks for 2)."""
        self.vllm_llm.sleep(level=1, **kwargs)

    @contextlib.contextmanager
    def serving(self, lora_requests: list[Any], seeds: list[int]) -> Iterator[None]:
        """While inside, `generate` serves row `i` with `lora_requests[i]` (None: the base model) and `seeds[i]`."""
        self._rows = (list(lora_requests), list(seeds))
        try:
            yield
        finally:
            self._rows = None

    def generate(self, prompts: Any, sampling_params: Any = None, **kwargs: Any) -> Any:
        """vLLM's `generate`, each row with its own LoRA request and seed inside `serving`."""
        if self._rows is None:
            return self.vllm_llm.generate(prompts, sampling_params, **kwargs)
        lora_requests, seeds = self._rows
        if len(prompts) != len(seeds):
            raise RuntimeError(f"vLLM got {len(prompts)} prompts for {len(seeds)} rows.")
        return self.vllm_llm.generate(
            prompts, sampling_params=with_seeds(sampling_params, seeds), lora_request=lora_requests, **kwargs
        )


def start_team_llm(
    num_adapters: int, lora_rank: int, dtype: torch.dtype | str, how_to_set: str, **settings: Any
) -> TeamLLM:
    """Start vLLM's `LLM` with `settings`, serving `num_adapters` LoRA adapters of rank at most `lora_rank` in `dtype`
    (`lora_engine_settings`), as a `TeamLLM`. The process's random generators are kept (`keep_process_rng`); a start
    that fails for lack of memory, or beside another open engine, says what to change (`naming_the_memory_setting`,
    `how_to_set`: where `vllm_gpu_memory_utilization` is passed)."""
    from vllm import LLM

    lora = lora_engine_settings(num_adapters, lora_rank, dtype)
    with naming_the_memory_setting(settings.get("gpu_memory_utilization"), how_to_set), keep_process_rng():
        return TeamLLM(LLM(**settings, **lora))


def bitsandbytes_quantization(model: Any) -> str | None:
    """The `quantization` vLLM loads `model`'s base with, detected as TRL 1.16's colocate engine detects it:
    `"bitsandbytes"` where the model has bitsandbytes 4-bit layers, else None; a model with bitsandbytes 8-bit layers
    is refused (vLLM has no in-flight 8-bit quantization)."""
    from transformers import is_bitsandbytes_available

    if not is_bitsandbytes_available():
        return None
    import bitsandbytes as bnb

    for _, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            return "bitsandbytes"
        if isinstance(module, bnb.nn.Linear8bitLt):
            raise ValueError("vLLM does not support in-flight 8-bit quantization.")
    return None


# The team engines of this process that are started and not closed, for the error of a start that fails beside them.
_open_engines: weakref.WeakSet = weakref.WeakSet()


def register_open_engine(engine: Any) -> None:
    """`engine` (with a `close_call`: what a user calls to close it) holds a started vLLM engine."""
    _open_engines.add(engine)


def unregister_open_engine(engine: Any) -> None:
    _open_engines.discard(engine)


@contextlib.contextmanager
def naming_the_memory_setting(utilization: float | None, how_to_set: str) -> Iterator[None]:
    """Start a vLLM engine; if it fails for lack of memory, or while another team engine of this process is open,
    raise again saying what to change: `vllm_gpu_memory_utilization` (`how_to_set` says where it is passed), or the
    call that closes the other engine. vLLM's own error follows, and is chained."""
    gc.collect()  # a finished trainer or a dropped team is often held in reference cycles
    release_freed_memory()  # on the CPU, what the process freed would count against the pool
    try:
        yield
    except Exception as error:
        others = sorted({engine.close_call for engine in list(_open_engines)})
        memory = "memory" in str(error).lower()
        if not (memory or others):
            raise
        if not others:  # drop what the failed start set up (vLLM's distributed state): the other engine still uses it
            shut_down_engine()
        hints = []
        if others:
            hints.append(
                f"This process still holds another vLLM engine, which keeps its memory: close it first "
                f"({' / '.join(f'`{call}`' for call in others)}), or run the two in different processes."
            )
        if memory:
            setting = "vLLM's default" if utilization is None else f"{utilization:g}"
            hints.append(
                f"vLLM could not reserve its memory with `vllm_gpu_memory_utilization` = {setting}: vLLM's pool is "
                "that share of the GPU's memory (on the CPU, of the machine's RAM, counting what this process holds "
                f"already). Pass {how_to_set}: a smaller one when less memory is free than the pool asks for, a "
                "larger one (or a smaller `vllm_max_model_length`) when what is left for the KV cache is too small."
            )
        message = " ".join(hints) + f" vLLM said: {type(error).__name__}: {error}"
        raise (ValueError if isinstance(error, ValueError) else RuntimeError)(message) from error


def check_vllm_installed() -> None:
    """Raise, saying how to install it, where vLLM is not installed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ImportError(
            '`use_vllm=True` needs vLLM: `pip install "trl-marl[vllm]"` on a GPU, or vLLM\'s CPU build '
            "(docs/vllm.md, Install); or set `use_vllm=False`."
        )


def check_quantization_served(load_in_4bit: bool) -> None:
    """Raise, saying what to do, when a 4-bit base is to be served by a vLLM without bitsandbytes quantization (vLLM
    0.31 has none; TRL asks for it whenever the trainer's base is 4-bit)."""
    if not load_in_4bit:
        return
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    if "bitsandbytes" not in QUANTIZATION_METHODS:
        from vllm import __version__

        raise ValueError(
            f"`use_vllm=True` with a 4-bit base (`load_in_4bit`): vLLM {__version__} has no bitsandbytes "
            "quantization, so it cannot serve a 4-bit base. Load the base unquantized (`load_in_4bit: false`, "
            "`model_init_kwargs: {dtype: bfloat16}`), or keep the 4-bit base and set `use_vllm=False`."
        )


def shut_down_engine() -> None:
    """Free a dropped engine's memory. vLLM's full cleanup also destroys torch.distributed's default process group:
    fine in one process (vLLM's own group, or accelerate's of world size 1), but under `accelerate launch` with several
    processes the group is the trainer's and must live on, so only vLLM's model-parallel state is dropped there."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory, destroy_model_parallel

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        destroy_model_parallel()
        gc.collect()
        empty_cache()
    else:
        cleanup_dist_env_and_memory()
    release_freed_memory()


def release_freed_memory() -> None:
    """Give the heap memory this process has freed back to the system (glibc's `malloc_trim`; elsewhere nothing). On
    the CPU vLLM's pool counts what the process holds (its resident memory), and glibc keeps most of a closed engine's
    and a finished trainer's freed memory: without this a second engine in the process may find its pool already
    used up (measured: 2.5 GiB resident after closing a trainer's engine, 1.15 GiB after the trim)."""
    # `memory.host.release_free_memory` does the same one layer up (this layer cannot import it).
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).malloc_trim(0)


def check_sharding_served(accelerator: Any) -> None:
    """Raise, saying why, under FSDP or DeepSpeed ZeRO-3: their adapters are sharded over processes, and the team
    engine saves each adapter from this process's parameters."""
    state = getattr(accelerator, "state", None)
    deepspeed = getattr(state, "deepspeed_plugin", None)
    if getattr(state, "fsdp_plugin", None) is not None or getattr(deepspeed, "zero_stage", 0) == 3:
        raise ValueError(
            "`use_vllm=True` is not supported with FSDP or DeepSpeed ZeRO-3: the adapters are sharded over the "
            "processes, while the team engine is sent each adapter as this process holds it. Use DDP or ZeRO-1/2 "
            "(a team's adapters are small), or `use_vllm=False`."
        )


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

    close_call = "team.close()"

    def __init__(
        self,
        base_model: str,
        adapter_folders: dict[str, str | Path],
        lora_rank: int,
        dtype: torch.dtype | str,
        **settings: Any,
    ):
        check_vllm_installed()
        from vllm.lora.request import LoRARequest

        check_quantization_served(settings.get("quantization") == "bitsandbytes")
        settings = {key: value for key, value in settings.items() if value is not None}
        how_to_set = "`load_team(..., vllm_gpu_memory_utilization=...)`"
        self.llm = start_team_llm(len(adapter_folders), lora_rank, dtype, how_to_set, model=base_model, **settings)
        register_open_engine(self)
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
        generation_config: Any = None,
    ) -> list[list[int]]:
        """Completion token ids of each prompt, row `i` served by adapter `adapters[i]`, ending at a stop token (kept):
        greedy, or sampled with `do_sample`, under the model's `generation_config` as transformers' `generate` reads
        it (`repetition_penalty` always; `temperature`, `top_k`, `top_p` when sampling). A sampled call draws one
        number from torch's random generator, as `generate` draws from it, and gives each row a seed made from it:
        after `torch.manual_seed(s)` the same call samples the same tokens."""
        from vllm import SamplingParams

        def setting(name: str, default: Any) -> Any:
            value = getattr(generation_config, name, None)
            return default if value is None else value

        sampling = {"temperature": setting("temperature", 1.0), "top_k": setting("top_k", 50) or -1}
        sampling["top_p"] = setting("top_p", 1.0)
        params = SamplingParams(
            max_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            repetition_penalty=setting("repetition_penalty", 1.0),
            **(sampling if do_sample else {"temperature": 0.0}),
        )
        if do_sample:
            call = int(torch.randint(0, 2**62, ()).item())
            params = with_seeds(params, [sampling_seed(call, row) for row in range(len(prompt_ids))])
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            params,
            lora_request=[self.lora_requests[adapter] for adapter in adapters],
            use_tqdm=False,
        )
        return [list(output.outputs[0].token_ids) for output in outputs]

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        unregister_open_engine(self)
        if self.llm is not None:
            self.llm = None
            shut_down_engine()
