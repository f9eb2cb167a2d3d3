"""Building and shutting down vLLM engines that serve a team: the LoRA settings of an engine, the checks that refuse
what vLLM cannot serve (with what to do instead), level-1 sleep, and `SavedTeamEngine`, which serves a team saved by
`save_model` for `load_team(..., use_vllm=True)`. The trainer's engine is `vllm_generation.TeamVLLMGeneration`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from trl.generation.vllm_generation import empty_cache

from .memory.vllm_engine import vllm_lora_rank


def lora_engine_settings(num_adapters: int, lora_rank: int, dtype: torch.dtype | str) -> dict[str, Any]:
    """The `vllm.LLM` arguments that serve `num_adapters` LoRA adapters of rank at most `lora_rank` in one batch, in
    `dtype` (the model's: vLLM would otherwise pick its own). `max_lora_rank` is the smallest value vLLM accepts
    that holds `lora_rank` (`memory.vllm_lora_rank`: a rank-4 adapter is served in rank-8 slots)."""
    return {
        "enable_lora": True,
        "max_loras": num_adapters,
        "max_lora_rank": vllm_lora_rank(lora_rank),
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
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory, destroy_model_parallel

    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        destroy_model_parallel()
        gc.collect()
        empty_cache()
    else:
        cleanup_dist_env_and_memory()


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

    def __init__(
        self,
        base_model: str,
        adapter_folders: dict[str, str | Path],
        lora_rank: int,
        dtype: torch.dtype | str,
        **settings: Any,
    ):
        check_vllm_installed()
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        check_quantization_served(settings.get("quantization") == "bitsandbytes")
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
        generation_config: Any = None,
    ) -> list[list[int]]:
        """Completion token ids of each prompt, row `i` served by adapter `adapters[i]`, ending at a stop token (kept):
        greedy, or sampled with `do_sample`, under the model's `generation_config` as transformers' `generate` reads
        it (`repetition_penalty` always; `temperature`, `top_k`, `top_p` when sampling)."""
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
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids],
            params,
            lora_request=[self.lora_requests[adapter] for adapter in adapters],
            use_tqdm=False,
        )
        return [list(output.outputs[0].token_ids) for output in outputs]

    def close(self) -> None:
        """Shut the engine down and free its memory."""
        if self.llm is not None:
            self.llm = None
            shut_down_engine()
