"""The memory planner with a colocated vLLM engine (`use_vllm=True`): each engine term against a hand-computed value,
the verdict on a card and its reasons, and the paper recipes' documented vLLM variants."""

import dataclasses
import math
import re
from pathlib import Path

import pytest
from transformers import AutoConfig, LlamaConfig

from trl_marl import ATGRPOConfig, MAGRPOConfig
from trl_marl.cli import main
from trl_marl.cli.command import estimate_config
from trl_marl.cli.train import parse_train_config
from trl_marl.memory import (
    CUDA_CONTEXT_BYTES,
    ENGINE_NON_TORCH_BYTES,
    GIB,
    VLLM_MAX_LORA_RANKS,
    GenerateCall,
    call_kv_tokens,
    engine_activation_bytes,
    engine_kv_cache_bytes,
    engine_pool_bytes,
    estimate_memory,
    kv_cache_tokens,
    largest_call_rows,
    lora_slot_bytes,
    model_shape,
    sequence_kv_tokens,
    vllm_lora_rank,
    vllm_max_num_seqs,
)

PAPER = Path(__file__).resolve().parents[1] / "recipes" / "paper"
# h 64, I 160, L 2, 4 heads of d = 16, 2 key/value heads: a layer's linears have Σ(in + out) = 1120
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4)
SMALL_SHAPE = model_shape(LlamaConfig(**SMALL, num_key_value_heads=2))


def vllm_config(tmp_path, **kwargs) -> MAGRPOConfig:
    defaults = dict(
        output_dir=str(tmp_path), agents=["writer", "critic"], use_cpu=True, report_to="none", use_vllm=True,
        model_init_kwargs={"dtype": "bfloat16"}, num_generations=4, per_device_train_batch_size=4,
        max_completion_length=32,
    )  # fmt: skip
    return MAGRPOConfig(**{**defaults, **kwargs})


def small_model_config(**kwargs) -> LlamaConfig:
    return LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=2048, **kwargs)


def test_the_pool_is_a_share_of_the_whole_card():
    assert engine_pool_bytes(16 * GIB, 0.3) == int(0.3 * 16 * GIB) == 5_153_960_755


def test_lora_slots_cover_every_linear_for_each_adapter_at_the_largest_rank():
    # 3 slots x L=2 x r=8 x Σ(in + out) = (64+64) + (64+32) + (64+32) + (64+64) + 3 x (64+160), in bf16
    assert lora_slot_bytes(SMALL_SHAPE, 3, 8, 2) == 3 * 2 * 8 * 1120 * 2 == 107_520


def test_lora_slots_use_the_rank_vllm_serves(tmp_path):
    assert VLLM_MAX_LORA_RANKS == (1, 8, 16, 32, 64, 128, 256, 320, 512)
    assert [vllm_lora_rank(rank) for rank in (1, 2, 4, 8, 12, 16, 17, 300, 512)] == [1, 8, 8, 8, 16, 16, 32, 320, 512]
    with pytest.raises(ValueError, match="up to 512"):
        vllm_lora_rank(513)
    # lora_r = 4 is served in rank-8 slots: 2 adapters x L=2 x r=8 x Σ(in + out) = 1120, in bf16
    engine = estimate_memory(vllm_config(tmp_path, lora_r=4), small_model_config()).vllm
    assert engine.max_lora_rank == 8 and engine.lora_slots == 2 * 2 * 8 * 1120 * 2
    assert ("vLLM: LoRA slots (2 x r=8, every linear)", engine.lora_slots) in engine.rows()


def test_a_4bit_trainer_base_with_vllm_is_refused_and_vllms_copy_is_unquantized(tmp_path):
    four_bit = estimate_memory(vllm_config(tmp_path), small_model_config(), load_in_4bit=True)
    unquantized = estimate_memory(vllm_config(tmp_path), small_model_config())
    assert four_bit.base_weights < unquantized.base_weights  # the trainer's NF4 base
    assert four_bit.vllm.weights == unquantized.vllm.weights == unquantized.base_weights  # vLLM's, in bf16
    assert four_bit.vllm.activations == unquantized.vllm.activations  # no bitsandbytes dequantization in vLLM
    failures, _ = four_bit.card_check(2)
    assert failures[0].startswith("vLLM cannot serve a 4-bit base (`load_in_4bit`")
    assert not four_bit.fits(24) and unquantized.card_check(2)[0] == []


def test_lora_slots_do_not_depend_on_the_adapters_targets(tmp_path):
    targets_two = estimate_memory(
        vllm_config(tmp_path, lora_target_modules=["q_proj", "v_proj"]), small_model_config()
    )
    targets_all = estimate_memory(vllm_config(tmp_path), small_model_config())
    assert targets_two.adapters < targets_all.adapters
    assert targets_two.vllm.lora_slots == targets_all.vllm.lora_slots == 2 * 2 * 16 * 1120 * 2


def test_engine_activation_peak_by_hand():
    # forward over 4096 tokens: residual + hidden (2·64) and the MLP's 3·160 (> attention's (2·4 + 2·2)·16 = 192) in
    # bf16, and Punica's fp32 buffer 3·T·r·4; the sampler on 4 rows is smaller
    forward = 4096 * (2 * 64 + 3 * 160) * 2 + 3 * 4096 * 8 * 4
    assert engine_activation_bytes(SMALL_SHAPE, 4096, 4, 2, 8, load_in_4bit=False) == forward == 5_373_952
    # a 4-bit base adds the shard bitsandbytes dequantizes: gate (64 x 160) in bf16
    assert engine_activation_bytes(SMALL_SHAPE, 4096, 4, 2, 8, load_in_4bit=True) == forward + 64 * 160 * 2
    # 16 tokens, 16 rows: the sampler dominates, the hidden states + R·V·(b_m + 12 + 12) (sorted for top-p / top-k)
    sampler = 16 * 64 * 2 + 16 * 1000 * (2 + 12 + 12)
    assert engine_activation_bytes(SMALL_SHAPE, 16, 16, 2, 8, load_in_4bit=False) == sampler == 418_048


def test_kv_cache_left_in_the_pool_and_its_tokens_by_hand():
    assert engine_kv_cache_bytes(1000, 100, 20, 30, 50) == 800
    assert engine_kv_cache_bytes(100, 100, 20, 30, 50) == -100
    token_bytes = 2 * 2 * 2 * 16 * 2  # 2·L·n_kv·d·b_m
    assert kv_cache_tokens(10 * 16 * token_bytes + token_bytes, token_bytes) == 160  # whole blocks of 16 tokens
    assert kv_cache_tokens(-5, token_bytes) == 0


def test_kv_tokens_of_a_sequence_and_of_a_call_by_hand():
    assert [sequence_kv_tokens(length) for length in (1, 16, 17)] == [16, 16, 32]
    assert call_kv_tokens(GenerateCall(64, 1024), 256, max_num_seqs=8) == 8 * 1280  # vLLM would run 8 of 64 at once
    assert call_kv_tokens(GenerateCall(64, 1024), 256, max_num_seqs=64) == 64 * 1280  # the team engine runs all 64
    assert call_kv_tokens(GenerateCall(3, 100), 10, max_num_seqs=8) == 3 * 112


def test_max_num_seqs_is_the_largest_team_call_not_trls_copies(tmp_path):
    # TRL's value: per_device_train_batch_size x steps_per_generation x tp = 1 x 8 x 1 = 8; the team's largest call is
    # the tree's second turn: 8 copies x G=4 children x 2 agents = 64 rows, all run at once
    tree = vllm_config(tmp_path, num_turns=2, per_device_train_batch_size=1, gradient_accumulation_steps=8)
    assert largest_call_rows(tree) == 8 * 4 * 2 and vllm_max_num_seqs(tree) == max(1 * 8 * 1, 64) == 64
    engine = estimate_memory(tree, small_model_config(), prompt_length=40).vllm
    # its prompt shows both first answers: 40 + 2 x 32, + 32 new tokens = 136, 144 in blocks of 16
    assert (engine.max_num_seqs, engine.call_tokens, engine.call) == (64, 64 * 144, "64 of 64 rows x 136")
    tree.vllm_tensor_parallel_size = 2  # set after validation: both values count every tensor-parallel rank
    assert vllm_max_num_seqs(tree) == max(1 * 8 * 2, 64 * 2) == 128
    # AT-GRPO: one call per scheduler phase (ATGRPOTrainer._generate_phase); `parallel` puts both agents in one phase,
    # 2 agents x 1 x 8 copies = 16 rows, twice TRL's value; `sequential` calls one agent's 8 copies, TRL's value itself
    atgrpo = dict(
        output_dir=str(tmp_path), agents=["planner", "coder"], num_turns=2, num_generations=4, use_vllm=True,
        per_device_train_batch_size=1, gradient_accumulation_steps=8, max_completion_length=32, use_cpu=True,
        report_to="none",
    )  # fmt: skip
    parallel = ATGRPOConfig(**atgrpo)
    assert largest_call_rows(parallel) == 2 * 8 and vllm_max_num_seqs(parallel) == max(1 * 8 * 1, 16) == 16
    engine = estimate_memory(parallel, small_model_config(), prompt_length=40).vllm
    # turn 1's call: both prompts show turn 0's 2 answers, 40 + 2 x 32, + 32 new tokens = 136, 144 in blocks of 16
    assert (engine.max_num_seqs, engine.call_tokens, engine.call) == (16, 16 * 144, "16 of 16 rows x 136")
    sequential = ATGRPOConfig(**atgrpo, scheduler="sequential")
    assert largest_call_rows(sequential) == 8 and vllm_max_num_seqs(sequential) == 1 * 8 * 1 == 8


def test_with_vllm_the_trainer_has_no_generation_phase_and_the_pool_sits_beside_it(tmp_path):
    config = vllm_config(tmp_path, vllm_gpu_memory_utilization=0.25, vllm_max_model_length=96)
    estimate = estimate_memory(config, small_model_config(), prompt_length=40)
    engine = estimate.vllm
    assert estimate.generation_phase == 0 and estimate.kv_cache == 0
    assert estimate.peak == estimate.static + estimate.training_phase + estimate.overhead
    assert engine.weights == estimate.base_weights  # vLLM loads the same base in the same dtype
    assert engine.kv_token_bytes == 2 * 2 * 2 * 16 * 2 and engine.max_model_len == 96
    # max_num_seqs = max(TRL's 4 copies x 1 step x 1 GPU, the one call's 4 copies x 2 agents) = 8: all 8 rows of
    # 40 + 32 tokens (80 in blocks of 16) at once
    assert (engine.max_num_seqs, engine.call_tokens, engine.call) == (8, 8 * 80, "8 of 8 rows x 72")
    assert engine.non_torch == ENGINE_NON_TORCH_BYTES
    card = 2 * GIB
    assert engine.pool(card) == int(0.25 * card)
    assert engine.kv_cache(card) == int(0.25 * card) - engine.fixed
    assert estimate.process_peak(2) == estimate.peak + int(0.25 * card)
    assert estimate.fits(2) and estimate.card_check(2) == ([], [])


def test_sleep_mode_holds_the_pool_only_while_vllm_generates(tmp_path):
    config = vllm_config(tmp_path, vllm_gpu_memory_utilization=0.25, vllm_max_model_length=96)
    config.vllm_enable_sleep_mode = True  # set after validation: the planner reads it as trl_marl's level-1 sleep
    estimate = estimate_memory(config, small_model_config(), prompt_length=40)
    pool = int(0.25 * 2 * GIB)
    expected = max(estimate.static + estimate.training_phase, estimate.static + pool) + estimate.overhead
    assert estimate.process_peak(2) == expected < estimate.peak + pool


def test_the_smallest_utilization_holds_what_the_kv_cache_needs(tmp_path):
    engine = estimate_memory(
        vllm_config(tmp_path, vllm_max_model_length=96), small_model_config(), prompt_length=40
    ).vllm
    card = 2 * GIB
    assert engine.needed_tokens() == 640  # 8 rows x 80 tokens at once > one 96-token sequence
    needed = engine.fixed + 640 * engine.kv_token_bytes
    smallest = engine.minimum_utilization(card)
    assert smallest == pytest.approx(math.ceil(needed / card * 100) / 100)
    kv_tokens = {
        utilization: estimate_memory(
            vllm_config(tmp_path, vllm_max_model_length=96, vllm_gpu_memory_utilization=utilization),
            small_model_config(),
            prompt_length=40,
        ).vllm.kv_tokens(card)
        for utilization in (smallest, round(smallest - 0.01, 2))
    }
    assert kv_tokens[smallest] >= 640 > kv_tokens[round(smallest - 0.01, 2)]


def test_verdict_names_a_kv_cache_that_cannot_hold_one_max_length_sequence(tmp_path):
    model_config = small_model_config()
    model_config.max_position_embeddings = 1_000_000  # vllm_max_model_length unset: vLLM takes the model's context
    estimate = estimate_memory(vllm_config(tmp_path, vllm_gpu_memory_utilization=0.3), model_config, prompt_length=40)
    failures, warnings = estimate.card_check(1)
    assert not estimate.fits(1) and len(failures) == 1 and warnings == []
    assert failures[0].startswith("vLLM refuses to start: the KV cache left in the pool")
    assert "cannot hold one vllm_max_model_length sequence (1,000,000 tokens, the model's)" in failures[0]
    assert f"{estimate.vllm.kv_tokens(GIB):,} tokens" in failures[0]
    assert "1 GB card: does NOT fit" in estimate.table([1]) and failures[0] in estimate.table([1])


def test_verdict_names_the_trainer_beside_the_pool_over_the_card(tmp_path):
    config = vllm_config(tmp_path, vllm_gpu_memory_utilization=0.5, vllm_max_model_length=96)
    estimate = estimate_memory(config, small_model_config(), prompt_length=40)
    at_start = CUDA_CONTEXT_BYTES + estimate.base_weights + estimate.adapters
    card = (at_start + estimate.peak) / 2 / 0.5  # half of it is free at start, too little for the trainer's peak
    failures, _ = estimate.card_check(card / GIB)
    assert [failure.split(":")[0] for failure in failures] == ["out of memory"]
    assert "the trainer's peak" in failures[0] and "beside vLLM's pool" in failures[0]


def test_verdict_names_a_pool_not_free_when_the_engine_starts(tmp_path):
    config = vllm_config(tmp_path, vllm_gpu_memory_utilization=0.95, vllm_max_model_length=96)
    estimate = estimate_memory(config, small_model_config(), prompt_length=40)
    held = CUDA_CONTEXT_BYTES + estimate.base_weights + estimate.adapters
    failures, _ = estimate.card_check(held * 10 / GIB)  # 95 % of the card is more than the 90 % left free
    assert any(failure.startswith("vLLM refuses to start: the trainer holds") for failure in failures)


def test_a_kv_cache_smaller_than_the_largest_call_is_a_warning_not_a_failure(tmp_path):
    config = vllm_config(tmp_path, vllm_max_model_length=96, max_completion_length=56)
    engine = estimate_memory(config, small_model_config(), prompt_length=40).vllm
    card = 4 * GIB  # a pool holding 4 of the 8 concurrent rows of 96 tokens (+ half a block, kept off a block's edge)
    utilization = (engine.fixed + (4 * 96 + 8) * engine.kv_token_bytes) / card
    config = vllm_config(
        tmp_path, vllm_max_model_length=96, max_completion_length=56, vllm_gpu_memory_utilization=utilization
    )
    estimate = estimate_memory(config, small_model_config(), prompt_length=40)
    failures, warnings = estimate.card_check(4)
    assert failures == [] and estimate.fits(4)
    assert len(warnings) == 1 and "vLLM queues rows" in warnings[0] and "8 of 8 rows x 96" in warnings[0]
    assert f"holds {4 * 96} tokens, fewer than the {8 * 96} of the largest call's rows" in warnings[0]


def test_cli_estimate_prints_the_engine_and_a_verdict_per_card(default_model_dir, tmp_path, capsys):
    path = tmp_path / "team.yaml"
    path.write_text(f"agents: [writer, critic]\noutput_dir: {tmp_path}\nnum_generations: 4\n")
    flags = ["--use_vllm", "true", "--vllm_gpu_memory_utilization", "0.35", "--vllm_max_model_length", "1024"]
    assert main(["estimate", str(path), "--gpu_memory_gb", "16", "24", *flags]) == 0
    printed = capsys.readouterr().out
    assert "vLLM: base weights (its own copy)" in printed and "vllm_gpu_memory_utilization=0.35" in printed
    assert "16 GB card: fits" in printed and "vLLM pool 5.6 GiB" in printed and "vLLM pool 8.4 GiB" in printed
    assert "generation: KV cache" not in printed  # the trainer does not generate


def test_a_vllm_estimate_on_the_cpu_says_the_pool_needs_a_gpu(tmp_path):
    estimate = estimate_memory(vllm_config(tmp_path), small_model_config(), device="cpu")
    assert "not predicted on the CPU" in estimate.table([16])
    with pytest.raises(ValueError, match="machine's RAM"):
        estimate.fits(16)


# Each paper recipe's documented vLLM variant (the command in its last comment block: the base unquantized, in bf16,
# as vLLM 0.31 cannot serve a 4-bit one), with the prompt bound and the model config its comment names: (recipe, model
# config, --prompt_length, fits 16 GB, fits 24 GB)
PAPER_VARIANTS = [
    ("magrpo_tldr.yaml", "Qwen3-1.7B", 512, True, True),
    ("magrpo_arxiv.yaml", "Qwen3-1.7B", 512, True, True),
    ("magrpo_humaneval.yaml", "Qwen2.5-Coder-3B", 512, False, True),
    ("atgrpo_math.yaml", "Qwen3-1.7B", 512, True, True),
    ("atgrpo_code_tester.yaml", "Qwen3-1.7B", 1024, False, True),  # with sleep mode only
    ("atgrpo_puzzles.yaml", "Qwen3-1.7B", 1024, False, True),  # with sleep mode only
]


def documented_vllm_flags(recipe: str) -> list[str]:
    """The flags of the `trl-marl train` command in the recipe's "vLLM variant" comment block."""
    block = (PAPER / recipe).read_text().split("# vLLM variant", 1)[1]
    command = re.search(rf"#   trl-marl train recipes/paper/{recipe} (.*?)\n#\n", block, re.S).group(1)
    return command.replace("\\\n#", " ").split()


def chosen_utilization(estimate) -> float:
    """The rule docs/memory.md states: the smallest multiple of 0.05 whose KV cache holds every row of the largest
    call, which the team engine runs at once (no failure, no warning), on every card, 16 or 24 GB, where the recipe
    fits at all; else the largest multiple of 0.05 that fits 24 GB."""

    def at(utilization):
        return dataclasses.replace(estimate, vllm=dataclasses.replace(estimate.vllm, utilization=utilization))

    steps = [round(0.05 * step, 2) for step in range(1, 20)]
    cards = [size for size in (16, 24) if any(at(utilization).fits(size) for utilization in steps)]
    for utilization in steps:
        if all(at(utilization).card_check(size) == ([], []) for size in cards):
            return utilization
    return max(utilization for utilization in steps if at(utilization).fits(24))


@pytest.mark.parametrize(("recipe", "model", "prompt_length", "fits_16", "fits_24"), PAPER_VARIANTS)
def test_paper_recipes_vllm_variants_fit_the_documented_cards(recipe, model, prompt_length, fits_16, fits_24):
    flags = documented_vllm_flags(recipe)
    assert flags[:4] == ["--use_vllm", "true", "--load_in_4bit", "false"] and "--vllm_max_model_length" in flags
    model_flags = ["--model_name_or_path", str(PAPER / "model_configs" / model)]
    estimate = estimate_config(str(PAPER / recipe), [*model_flags, *flags], prompt_length)
    engine = estimate.vllm
    assert estimate.details["4-bit"] is False and engine.weights == estimate.base_weights  # both copies in bf16
    # the context covers the planner's longest prompt + completion, and vLLM serves both agents' adapters
    assert engine.max_model_len == estimate.details["training sequence length"]
    assert (engine.max_loras, engine.max_lora_rank) == (2, 16)
    assert engine.utilization == chosen_utilization(estimate)
    assert (estimate.fits(16), estimate.fits(24)) == (fits_16, fits_24)
    assert estimate.card_check(24)[0] == [] and estimate.vllm.kv_tokens(24 * GIB) >= engine.max_model_len
    # the figures the comment gives are the planner's
    comment = " ".join((PAPER / recipe).read_text().split("# vLLM variant", 1)[1].replace("\n#", " ").split())
    for size in (24, 16) if fits_16 else (24,):
        assert f"{estimate.process_peak(size) / GIB:.1f} GiB on a {size} GB card" in comment
    assert f"the trainer's {estimate.peak / GIB:.1f} GiB" in comment


@pytest.mark.parametrize("recipe", ["atgrpo_code_tester.yaml", "atgrpo_puzzles.yaml"])
def test_the_longest_atgrpo_recipes_fit_24_gb_with_vllm_only_in_sleep_mode(recipe):
    flags = documented_vllm_flags(recipe)
    assert flags[-2:] == ["--vllm_enable_sleep_mode", "true"]
    script_args, args = parse_train_config(str(PAPER / recipe), ["--bf16", "true", "--use_cpu", "true", *flags])
    model_config = AutoConfig.from_pretrained(PAPER / "model_configs" / "Qwen3-1.7B")
    estimate = estimate_memory(args, model_config, load_in_4bit=script_args.load_in_4bit, prompt_length=1024)
    # the documented U holds every row on 24 GB, and the peak is the trainer's own (its static part + the pool is less)
    assert estimate.card_check(24) == ([], []) and estimate.process_peak(24) == estimate.peak
    # without sleep mode, the bf16 trainer beside a pool with any KV cache is over 24 GB at every utilization
    awake = dataclasses.replace(estimate.vllm, sleep_mode=False)
    for utilization in [round(0.05 * step, 2) for step in range(1, 20)]:
        at = dataclasses.replace(estimate, vllm=dataclasses.replace(awake, utilization=utilization))
        assert not at.fits(24)
