"""Device placement decisions that only a GPU run would exercise, checked from the CPU."""

from types import SimpleNamespace

import torch
from transformers import BitsAndBytesConfig

from trl_marl.trainer import model_init_kwargs_for

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
