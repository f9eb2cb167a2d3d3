"""What vLLM accepts, as trl_marl meets it: the LoRA ranks it serves, the tokens TRL's engine schedules in one step,
and the vLLM mode a team cannot use. Free of torch and vLLM, so that the configs and the memory planner read them
without importing either."""

# Why `vllm_mode='server'` is refused (by the configs, and by the team's engine).
SERVER_MODE_REASON = (
    "`vllm_mode='server'` is not supported: TRL's `trl vllm-serve` server receives merged full weights, one policy, "
    "while each agent needs its own adapter in the same batch. Use `vllm_mode='colocate'`, which serves every agent's "
    "adapter as a LoRA from one engine in the trainer's process."
)

# The tokens TRL's colocated vLLM engine schedules in one step (`max_num_batched_tokens`, set by TRL); vLLM refuses a
# `max_num_seqs` above it.
VLLM_MAX_NUM_BATCHED_TOKENS = 4096

# The LoRA ranks vLLM accepts as `max_lora_rank` (its slot sizes); trl_marl serves an adapter in the smallest that
# holds its rank. Free of torch and vLLM, for the planner and `vllm_serving.lora_engine_settings`.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(lora_rank: int) -> int:
    """The `max_lora_rank` vLLM is given for adapters of rank at most `lora_rank`: the smallest of
    `VLLM_MAX_LORA_RANKS` (1, 8, 16, 32, 64, 128, 256, 320, 512) that holds it (a rank-4 adapter is served in rank-8
    slots). Raises `ValueError` above 512."""
    supported = [rank for rank in VLLM_MAX_LORA_RANKS if rank >= lora_rank]
    if not supported:
        raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANKS[-1]}; `lora_r` is {lora_rank}.")
    return supported[0]
