"""A team on a 4-bit NF4 base (bitsandbytes, on the CPU here): every adapter trains, the quantized base does not."""

import pytest
import torch
from datasets import Dataset
from test_resume import StopAt, adapters, make_trainer

from trl_marl import MAGRPOConfig, MAGRPOTrainer

bitsandbytes = pytest.importorskip("bitsandbytes", reason="bitsandbytes is needed for 4-bit bases")


def team_reward(prompts, completions, **kwargs):
    return [float(len(c["writer"]) - len(c["critic"])) for c in completions]


def test_two_agents_train_on_a_4bit_nf4_base(default_model_dir, tmp_path):
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    args = MAGRPOConfig(
        output_dir=str(tmp_path),
        agents=[{"name": "writer", "system_prompt": "Write."}, {"name": "critic", "system_prompt": "Criticise."}],
        num_generations=2,
        per_device_train_batch_size=4,
        max_completion_length=4,
        max_steps=2,
        learning_rate=1e-2,
        lora_r=4,
        lora_target_modules=["q_proj", "v_proj"],
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
    )
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "Name a colour."}], [{"role": "user", "content": "Say hi."}]]}
    )
    trainer = MAGRPOTrainer(
        default_model_dir, team_reward, args=args, train_dataset=dataset, quantization_config=quantization
    )
    linear4bit = [m for m in trainer.model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit)]
    assert linear4bit, "the base should be quantized"
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    for agent in ("writer", "critic"):
        names = [n for n in adapters if f".{agent}." in n]
        assert any(not torch.equal(adapters[n], after[n].detach()) for n in names), f"{agent} did not train"
    for name, value in frozen.items():
        assert torch.equal(value, after[name].detach()), f"base weight {name} changed"


def test_frozen_adapters_take_the_trained_adapters_dtype_on_a_4bit_base(tiny_model_dir, tmp_path):
    # TRL casts the adapters that require grad to bf16 on a quantized base; a frozen agent's adapter must follow, or
    # every routed matmul of a mixed batch (the agents' matrices concatenated) would promote to float32.
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    args = MAGRPOConfig(
        output_dir=str(tmp_path),
        agents=["writer", "critic", "reader"],
        frozen_agents=["reader"],
        num_generations=2,
        max_completion_length=3,
        report_to="none",
        use_cpu=True,
    )
    dataset = Dataset.from_dict({"prompt": ["Say hi."]})
    trainer = MAGRPOTrainer(
        tiny_model_dir, team_reward, args=args, train_dataset=dataset, quantization_config=quantization
    )
    dtypes = {
        agent: {p.dtype for n, p in trainer.model.named_parameters() if f".{agent}." in n and "lora_" in n}
        for agent in ("writer", "critic", "reader")
    }
    assert dtypes == {"writer": {torch.bfloat16}, "critic": {torch.bfloat16}, "reader": {torch.bfloat16}}
    assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if ".reader." in n)


def test_resuming_a_4bit_team_keeps_its_adapters_dtype_and_equals_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """On resume, transformers reloads each adapter with PEFT's `load_adapter`, which upcasts it to float32 and
    replaces its parameters; on a 4-bit base the adapters train in bf16, and a resumed run must go on in bf16."""
    from transformers import BitsAndBytesConfig

    def four_bit():
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)

    settings = dict(max_steps=4, agents=["concise", "detailed", "reader"], frozen_agents=["reader"])
    uninterrupted = make_trainer(tiny_model_dir, tmp_path / "a", quantization_config=four_bit(), **settings)
    uninterrupted.train()
    first = make_trainer(
        tiny_model_dir, tmp_path / "b", quantization_config=four_bit(), save_strategy="steps", save_steps=2, **settings
    )
    first.add_callback(StopAt(2))
    first.train()
    resumed = make_trainer(tiny_model_dir, tmp_path / "b", quantization_config=four_bit(), **settings)
    parameters = {name: p for name, p in resumed.model.named_parameters() if "lora_" in name}
    resumed.train(resume_from_checkpoint=True)
    # The reloaded values went into the parameters the trainer holds (PEFT's reload makes new ones).
    assert all(p is parameters[name] for name, p in resumed.model.named_parameters() if "lora_" in name)

    assert resumed.state.global_step == 4
    expected, final = adapters(uninterrupted), adapters(resumed)
    assert {p.dtype for p in expected.values()} == {torch.bfloat16}
    assert {name: p.dtype for name, p in final.items()} == {name: p.dtype for name, p in expected.items()}
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=0, atol=0, msg=name)
    assert not any(p.requires_grad for n, p in resumed.model.named_parameters() if ".reader." in n)
