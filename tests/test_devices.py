"""Device placement decisions that only a GPU run would exercise, checked from the CPU."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers import BitsAndBytesConfig

from trl_marl import MAGRPOConfig, precision
from trl_marl.precision import default_mixed_precision, model_init_kwargs_for

GPU_1 = torch.device("cuda", 1)


def args_on(distributed_type, device=GPU_1, **model_init_kwargs):
    state = SimpleNamespace(distributed_type=distributed_type, device=device)
    return SimpleNamespace(distributed_state=state, model_init_kwargs=model_init_kwargs, trust_remote_code=False)


def test_under_ddp_a_4bit_base_loads_on_this_processs_device():
    four_bit = BitsAndBytesConfig(load_in_4bit=True)
    for distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        kwargs = model_init_kwargs_for(args_on(distributed_type, dtype="bfloat16"), four_bit)
        assert kwargs == {
            "dtype": "bfloat16",
            "quantization_config": four_bit,
            "device_map": {"": torch.device("cuda", 1)},
            "trust_remote_code": False,
        }
    given_in_config = model_init_kwargs_for(args_on("MULTI_GPU", quantization_config=four_bit))
    assert given_in_config["device_map"] == {"": torch.device("cuda", 1)}


def test_under_ddp_an_unquantized_base_has_no_device_map_and_one_process_keeps_the_default():
    assert model_init_kwargs_for(args_on("MULTI_GPU"))["device_map"] is None  # "auto" would spread it over GPUs
    single = model_init_kwargs_for(
        args_on("NO", device=torch.device("cuda", 0)), BitsAndBytesConfig(load_in_4bit=True)
    )
    assert "device_map" not in single  # TRL's create_model_from_path then picks "auto" on a GPU


def gpu(monkeypatch, bf16_supported):
    """Make torch report a CUDA GPU with or without bf16 (only the queries trl_marl's precision choice makes)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "Tesla T4" if not bf16_supported else "A100")


def test_half_precision_is_bf16_only_where_the_gpu_supports_it(monkeypatch):
    assert precision.half_precision_dtype() is None  # no GPU here
    assert precision.four_bit_config().bnb_4bit_compute_dtype == torch.float32
    gpu(monkeypatch, bf16_supported=True)
    assert precision.half_precision_dtype() is torch.bfloat16
    assert precision.four_bit_config().bnb_4bit_compute_dtype == torch.bfloat16
    gpu(monkeypatch, bf16_supported=False)
    assert precision.half_precision_dtype() is torch.float16
    assert precision.four_bit_config().bnb_4bit_compute_dtype == torch.float16


def test_an_unset_bf16_becomes_fp16_on_a_gpu_without_bf16_and_says_so(monkeypatch, caplog):
    gpu(monkeypatch, bf16_supported=False)
    with caplog.at_level(logging.WARNING, logger="trl_marl"):
        assert default_mixed_precision(None, False, use_cpu=False) == (False, True)
    assert "Tesla T4" in caplog.text and "fp16" in caplog.text
    assert default_mixed_precision(True, False, use_cpu=False) == (True, False)  # an explicit choice is kept
    assert default_mixed_precision(None, False, use_cpu=True) == (False, False)  # the CPU trains in float32
    gpu(monkeypatch, bf16_supported=True)
    assert default_mixed_precision(None, False, use_cpu=False) == (None, False)  # TRL's default: bf16


def test_an_unset_bf16_without_a_gpu_or_use_cpu_says_which_field_to_set(tmp_path):
    assert precision.half_precision_dtype() is None  # no GPU here
    with pytest.raises(ValueError, match=r"no GPU that supports it\. To train on the CPU, set `use_cpu=True`"):
        MAGRPOConfig(output_dir=str(tmp_path), agents=["writer", "critic"])
    config = MAGRPOConfig(output_dir=str(tmp_path), agents=["writer", "critic"], bf16=False)  # a choice is kept
    assert (config.bf16, config.fp16, config.use_cpu) == (False, False, False)


def test_torch_compile_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"`torch_compile=True` is not supported.*recompile.*torch_compile=False"):
        MAGRPOConfig(output_dir=str(tmp_path), agents=["writer", "critic"], torch_compile=True, use_cpu=True)


def test_paper_recipes_leave_the_precision_to_the_config():
    for recipe in (Path(__file__).parents[1] / "recipes" / "paper").glob("*.yaml"):
        keys = yaml.safe_load(recipe.read_text())
        assert "bf16" not in keys and "fp16" not in keys, recipe.name
