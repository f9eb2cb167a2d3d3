"""The memory planner: its formulas against hand-computed values and the real libraries, and one measured peak."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from trl_marl import ATGRPOConfig, MAGRPOConfig
from trl_marl.memory import (
    CUDA_CONTEXT_BYTES,
    estimate_memory,
    lora_parameters,
    model_shape,
    nf4_bytes,
    optimizer_state_bytes,
    parameter_count,
    rollout_geometry,
)

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4)


def team_config(tmp_path, **kwargs) -> MAGRPOConfig:
    defaults = dict(output_dir=str(tmp_path), agents=["writer", "critic"], use_cpu=True, report_to="none")
    return MAGRPOConfig(**{**defaults, **kwargs})


def meta_parameter_count(config) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def test_parameter_count_of_the_default_models_config_is_the_real_models(default_model_dir):
    from safetensors import safe_open

    with safe_open(f"{default_model_dir}/model.safetensors", "pt") as checkpoint:
        stored = sum(math.prod(checkpoint.get_slice(name).get_shape()) for name in checkpoint.keys())
    config = AutoConfig.from_pretrained(default_model_dir)
    # 49152·576 embeddings (tied) + 30 layers · 3,540,096 + 576 final norm
    assert parameter_count(model_shape(config)) == stored == 134_515_008


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
        LlamaConfig(**SMALL, num_key_value_heads=1, head_dim=32),
        Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=True),
        Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
    ],
    ids=["llama-untied-biases", "llama-gqa-head-dim", "qwen2-qkv-bias", "qwen3-qk-norm"],
)
def test_parameter_count_equals_the_instantiated_architecture(config):
    assert parameter_count(model_shape(config)) == meta_parameter_count(config)


def test_an_unknown_architecture_is_rejected_by_name():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="model_type='gpt2'"):
        model_shape(GPT2Config())


@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"], ["down_proj"]])
def test_lora_parameters_equal_peft_count(targets):
    from peft import LoraConfig, get_peft_model

    config = LlamaConfig(**SMALL, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    peft_targets = "all-linear" if targets == ["all-linear"] else targets
    model = get_peft_model(model, LoraConfig(r=4, target_modules=peft_targets, task_type="CAUSAL_LM"))
    counted = sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)
    assert lora_parameters(model_shape(config), 4, targets) == counted


def test_lora_parameters_by_hand():
    # SmolLM2-135M layer, r=16: q 576+576, k 576+192, v 576+192, o 576+576, gate/up 576+1536, down 1536+576
    smollm2 = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    shape = model_shape(LlamaConfig(**{**SMALL, **smollm2, "num_hidden_layers": 30}))
    assert lora_parameters(shape, 16, ["all-linear"]) == 30 * 16 * (1152 + 768 + 768 + 1152 + 3 * 2112)
    assert lora_parameters(shape, 16, ["q_proj", "v_proj"]) == 30 * 16 * (1152 + 768) == 921_600
    with pytest.raises(ValueError, match="qkv_proj"):
        lora_parameters(shape, 16, ["qkv_proj"])


def test_nf4_bytes_by_hand():
    # 64x64 weight: 2048 packed bytes, 64 uint8 absmax, one fp32 second-level absmax, codes and offset (1092)
    assert nf4_bytes(64 * 64) == 2048 + 64 + 4 + 1092


def test_4bit_base_bytes_equal_bitsandbytes_on_a_tiny_model(tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is needed for 4-bit bases")
    import bitsandbytes as bnb

    from trl_marl.precision import four_bit_config

    config = LlamaConfig(**SMALL, num_key_value_heads=2, tie_word_embeddings=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=four_bit_config())
    held = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied lm_head is counted once
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state = module.weight.quant_state
            tensors = [state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code]
            held += sum(t.numel() * t.element_size() for t in tensors)
    estimate = estimate_memory(team_config(tmp_path), config, load_in_4bit=True, device="cpu")
    assert estimate.base_weights == held


def test_optimizer_state_bytes():
    assert optimizer_state_bytes("adamw_torch_fused", 4) == 8
    assert optimizer_state_bytes("adamw_torch", 2) == 4  # torch keeps the states in the parameter's dtype
    assert optimizer_state_bytes("paged_adamw_8bit", 2) == pytest.approx(2.03125)
    assert optimizer_state_bytes("sgd", 4) == 0
    with pytest.raises(ValueError, match="rmsprop"):
        optimizer_state_bytes("rmsprop", 4)


def test_rollout_geometry_of_a_two_turn_tree(tmp_path):
    # 1 copy x 8 steps_per_generation = 8 copies; turn 1: 8 x 2 agents; turn 2: 8 x G=4 children x 2 agents
    config = team_config(
        tmp_path, num_generations=4, num_turns=2, per_device_train_batch_size=1, gradient_accumulation_steps=8,
        max_completion_length=256,
    )  # fmt: skip
    calls, rows, seq_len = rollout_geometry(config, prompt_length=300)
    assert [(call.rows, call.prompt_length) for call in calls] == [(16, 300), (64, 300 + 2 * 256)]
    assert rows == (16 + 64) // 8 == 10
    assert seq_len == 300 + 2 * 256 + 256


def test_rollout_geometry_of_cross_mode_and_a_sequential_scheduler(tmp_path):
    cross = team_config(tmp_path, num_generations=2, joint_mode="cross", num_turns=2, per_device_train_batch_size=2)
    calls, rows, _ = rollout_geometry(cross, prompt_length=10)
    assert [call.rows for call in calls] == [2 * 2, 2 * 4 * 2]  # 4 = G^N joint actions open a child each
    sequential = team_config(
        tmp_path, num_generations=2, scheduler="sequential", per_device_train_batch_size=2, max_completion_length=256
    )
    calls, rows, seq_len = rollout_geometry(sequential, prompt_length=10)
    assert [(call.rows, call.prompt_length) for call in calls] == [(2, 10), (2, 10 + 256)]
    assert (rows, seq_len) == (4, 10 + 256 + 256)


def atgrpo_config(tmp_path, **kwargs) -> ATGRPOConfig:
    defaults = dict(
        output_dir=str(tmp_path), agents=["planner", "coder"], num_turns=2, num_generations=4,
        per_device_train_batch_size=4, max_completion_length=50, use_cpu=True, report_to="none",
    )  # fmt: skip
    return ATGRPOConfig(**{**defaults, **kwargs})


def test_rollout_geometry_of_atgrpo_one_call_per_phase(tmp_path):
    # `parallel` (the default): one phase of both agents a turn, one call of 2 agents x 4 copies = 8 rows
    # (ATGRPOTrainer._generate_phase); both prompts of a phase see the earlier turns only: turn 1 shows turn 0's 2
    # answers, 100 + 2 x 50
    calls, rows, seq_len = rollout_geometry(atgrpo_config(tmp_path), prompt_length=100)
    assert [(call.rows, call.prompt_length) for call in calls] == [(8, 100), (8, 200)]
    assert (rows, seq_len) == (4 * 2 * 2, 200 + 50)
    # `debate`: one phase a turn too; turn 1 shows the other agent's answer only, 100 + 1 x 50
    calls, rows, seq_len = rollout_geometry(atgrpo_config(tmp_path, scheduler="debate"), prompt_length=100)
    assert [(call.rows, call.prompt_length) for call in calls] == [(8, 100), (8, 150)]
    assert (rows, seq_len) == (16, 150 + 50)
    # `sequential`: one agent a phase, 4 rows a call, each prompt showing every earlier answer
    calls, rows, seq_len = rollout_geometry(atgrpo_config(tmp_path, scheduler="sequential"), prompt_length=100)
    assert [(call.rows, call.prompt_length) for call in calls] == [(4, 100), (4, 150), (4, 200), (4, 250)]
    assert (rows, seq_len) == (16, 300)


def test_kv_cache_and_router_weights_by_hand(default_model_dir, tmp_path):
    config = team_config(tmp_path, num_generations=4, per_device_train_batch_size=4, max_completion_length=32)
    estimate = estimate_memory(config, AutoConfig.from_pretrained(default_model_dir), prompt_length=40, device="cpu")
    rows, length = 4 * 2, 40 + 32  # 4 copies, each answered by both agents
    assert estimate.kv_cache == 2 * 30 * 3 * 64 * 4 * rows * length  # 2·L·n_kv·d·b_m·R·(P + C)
    per_row = 30 * 16 * (1152 + 768 + 768 + 1152 + 3 * 2112)  # L · Σ r·(in + out)
    assert estimate.routed_lora_weights == 2 * per_row * 4  # both adapters concatenated, not a copy per row
    assert estimate.adapters == 2 * per_row * 4 and estimate.optimizer_states == 2 * estimate.adapters


def test_the_captured_decode_steps_memory_by_hand_on_a_gpu_and_none_of_it_when_off(default_model_dir, tmp_path):
    model_config = AutoConfig.from_pretrained(default_model_dir)
    settings = dict(num_generations=4, per_device_train_batch_size=4, max_completion_length=32)
    gpu = estimate_memory(team_config(tmp_path, **settings), model_config, prompt_length=40, device="cuda")  # on
    # One call of 8 rows (bucket 8) needing 40 + 32 positions (bucket 256): its cache lives through the rollout.
    assert gpu.kv_cache == 2 * 30 * 3 * 64 * 4 * 8 * 256  # 2·L·n_kv·d·b_m·R_b·length
    # (N + 1)·L·r·Σ(in + |G|·out)·b_a: both adapters for mixed calls and one for a call on one agent; q/k/v (|G| = 3)
    # and gate/up (2) each share one block-diagonal B
    inputs, outputs = 6 * 576 + 1536, 3 * (576 + 192 + 192) + 576 + 2 * (1536 + 1536) + 576
    copies = (2 + 1) * 30 * 16 * (inputs + outputs) * 4
    pool = 8 * (49152 * 4 + 2 * 576 * 4 + 4 * 576 + 4 * 9 * 64 * 4 + 3 * 1536 * 4)  # R·(V·b_m + one layer)
    assert gpu.captured_decode == copies + pool and gpu.routed_lora_weights == 0  # static, for the whole run
    assert gpu.static == gpu.base_weights + gpu.adapters + gpu.optimizer_states + gpu.captured_decode
    assert "captured decode: adapter copies, graph pool" in gpu.table()
    eager = estimate_memory(
        team_config(tmp_path, **settings, captured_decode=False), model_config, prompt_length=40, device="cuda"
    )
    assert eager.captured_decode == 0 and eager.kv_cache == 2 * 30 * 3 * 64 * 4 * 8 * (40 + 32)
    assert eager.routed_lora_weights == 2 * 30 * 16 * (1152 + 768 + 768 + 1152 + 3 * 2112) * 4  # N·L·Σ r·(in + out)
    cpu = estimate_memory(team_config(tmp_path, **settings), model_config, prompt_length=40, device="cpu")
    assert cpu.captured_decode == 0  # off by default on the CPU


def test_the_captured_decode_steps_caches_add_up_over_row_buckets():
    from trl_marl.memory import GenerateCall, captured_call, captured_kv_cache_bytes, kv_cache_bytes, model_shape

    shape = model_shape(AutoConfig.for_model("llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4))
    calls = [GenerateCall(4, 100), GenerateCall(16, 200), GenerateCall(8, 400)]
    bucketed = [captured_call(call, 50) for call in calls]
    assert [(c.rows, c.prompt_length + 50) for c in bucketed] == [(8, 256), (16, 256), (8, 512)]
    # Rows 4 and 8 share the 8-row bucket, whose cache grows to the longer call; the 16-row bucket has its own.
    expected = kv_cache_bytes(shape, 8, 512, 2) + kv_cache_bytes(shape, 16, 256, 2)
    assert captured_kv_cache_bytes(shape, bucketed, 50, 2) == expected


def test_4bit_adapters_are_bf16_and_the_gpu_adds_the_cuda_context(default_model_dir, tmp_path):
    model_config = AutoConfig.from_pretrained(default_model_dir)
    config = team_config(tmp_path)
    gpu = estimate_memory(config, model_config, load_in_4bit=True, device="cuda")
    cpu = estimate_memory(config, model_config, load_in_4bit=True, device="cpu")
    assert gpu.adapters == 2 * lora_parameters(model_shape(model_config), 16, ["all-linear"]) * 2
    assert gpu.overhead >= CUDA_CONTEXT_BYTES and cpu.overhead == 0
    assert gpu.base_weights < 0.4 * parameter_count(model_shape(model_config)) * 4


def test_gradient_checkpointing_keeps_less(default_model_dir, tmp_path):
    model_config = AutoConfig.from_pretrained(default_model_dir)
    kept = estimate_memory(team_config(tmp_path, gradient_checkpointing=False), model_config, prompt_length=200)
    checkpointed = estimate_memory(team_config(tmp_path, gradient_checkpointing=True), model_config, prompt_length=200)
    assert checkpointed.saved_activations < kept.saved_activations / 10


def test_table_says_whether_each_card_fits(default_model_dir, tmp_path):
    estimate = estimate_memory(team_config(tmp_path), AutoConfig.from_pretrained(default_model_dir))
    table = estimate.table([0.5, 24])
    assert "0.5 GB card: does NOT fit" in table and "24 GB card: fits" in table
    assert "KV cache" in str(estimate)


def test_the_table_says_which_memory_it_predicts(default_model_dir, tmp_path):
    model_config = AutoConfig.from_pretrained(default_model_dir)
    gpu = estimate_memory(team_config(tmp_path), model_config).table([24])
    cpu = estimate_memory(team_config(tmp_path), model_config, device="cpu").table([24])
    assert gpu.startswith("Predicted peak memory on one GPU (") and "24 GB card: fits" in gpu
    assert cpu.startswith("Predicted peak memory in RAM, for training on the CPU (use_cpu: true)")
    assert "24 GiB of RAM: fits" in cpu and "card" not in cpu and "cuda" not in cpu


def test_cli_estimate_prints_the_breakdown(tmp_path, capsys):
    from trl_marl.cli import main

    path = tmp_path / "team.yaml"
    path.write_text(f"agents: [writer, critic]\noutput_dir: {tmp_path}\nnum_generations: 4\nuse_cpu: true\n")
    assert main(["estimate", str(path), "--prompt_length", "64", "--gpu_memory_gb", "16"]) == 0
    printed = capsys.readouterr().out  # use_cpu: true trains on the CPU, so the prediction is of its RAM
    assert "PEAK" in printed and "in RAM, for training on the CPU" in printed and "16 GiB of RAM: fits" in printed
    assert "cuda" not in printed and "card" not in printed
    assert main(["estimate", str(path), "--prompt_length", "64", "--gpu_memory_gb", "16", "--use_cpu", "false"]) == 0
    printed = capsys.readouterr().out
    assert "on one GPU" in printed and "16 GB card: fits" in printed


def test_cli_estimate_keeps_bf16_on_without_a_gpu(tmp_path, capsys):
    from trl_marl.cli import main

    path = tmp_path / "team.yaml"  # no use_cpu: transformers would refuse bf16 here without the planner's help
    path.write_text(f"agents: [writer, critic]\noutput_dir: {tmp_path}\nnum_generations: 4\nbf16: true\n")
    assert main(["estimate", str(path), "--gpu_memory_gb", "24"]) == 0
    assert "24 GB card: fits" in capsys.readouterr().out


def test_model_init_kwargs_dtype_is_the_dtype_of_unquantized_weights(default_model_dir, tmp_path):
    model_config = AutoConfig.from_pretrained(default_model_dir)
    float32 = estimate_memory(team_config(tmp_path), model_config)
    bfloat16 = estimate_memory(team_config(tmp_path, model_init_kwargs={"dtype": "bfloat16"}), model_config)
    assert float32.base_weights == 4 * 134_515_008 and bfloat16.base_weights == 2 * 134_515_008
    assert bfloat16.kv_cache == float32.kv_cache // 2


def test_prediction_is_within_25_percent_of_measured_peak_on_the_cpu():
    """One small configuration (fp32, 1 agent, 2 copies x 60 tokens, 2 steps) measured in its own process by
    recipes/benchmarks/bench_memory.py: peak RSS over the RSS just before the model loads (see its docstring)."""
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "recipes" / "benchmarks" / "bench_memory.py")
    bench_memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench_memory)
    row = bench_memory.check("test")
    assert row["measured"] > 500 * 2**20, row  # the float32 weights alone are 513 MiB: the measurement saw them
    assert abs(row["error_percent"]) <= 25, row
