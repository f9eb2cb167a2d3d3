"""One agent, aligned, single turn: MAGRPO is GRPO, so MAGRPOTrainer must match TRL's GRPOTrainer."""

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig, GRPOTrainer

from trl_marl import MAGRPOConfig, MAGRPOTrainer

PROMPTS = ["Name a colour.", "Name a fruit.", "Count to three.", "Say hello."]


def fixed_completions(prompt_ids, eos_id):
    """Deterministic completions of varied lengths, so both trainers see exactly the same samples."""
    return [
        [(sum(ids) + 7 * i + k) % 4000 + 100 for k in range(1 + i % 5)] + [eos_id] for i, ids in enumerate(prompt_ids)
    ]


def length_reward(completions):
    return [float(len(text)) / 10.0 for text in completions]


def grpo_reward(prompts, completions, **kwargs):
    return length_reward([c[0]["content"] for c in completions])


def team_reward(prompts, completions, **kwargs):
    return length_reward([c["solo"] for c in completions])


def common_args(output_dir, loss_type, beta):
    return dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=5e-2,
        loss_type=loss_type,
        beta=beta,
        seed=11,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,  # explicit for both: MAGRPOConfig turns TRL's bf16 default off with use_cpu=True
    )


def run(trainer_cls, config_cls, model_dir, reward, output_dir, loss_type, beta, **extra):
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = config_cls(**common_args(output_dir, loss_type, beta), **extra)
    trainer = trainer_cls(model_dir, reward, args=args, train_dataset=dataset, peft_config=lora)
    eos_id = trainer.processing_class.eos_token_id
    trainer._generate_single_turn = lambda prompt_ids, *a, **k: (fixed_completions(prompt_ids, eos_id), None)
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    trainer.train()
    final = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    return initial, final, losses, rewards


@pytest.mark.parametrize(("loss_type", "beta"), [("grpo", 0.0), ("dapo", 0.0), ("dapo", 0.1)])
def test_single_agent_matches_grpo_trainer(tiny_model_dir, tmp_path, loss_type, beta):
    trl_init, trl_final, trl_losses, trl_rewards = run(
        GRPOTrainer, GRPOConfig, tiny_model_dir, grpo_reward, tmp_path / "trl", loss_type, beta
    )
    marl_init, marl_final, marl_losses, marl_rewards = run(
        MAGRPOTrainer, MAGRPOConfig, tiny_model_dir, team_reward, tmp_path / "marl", loss_type, beta, agents=["solo"]
    )
    as_trl = {name.replace(".solo.", ".default."): value for name, value in marl_final.items()}
    assert set(as_trl) == set(trl_final)
    for name in trl_init:  # same seed, same adapter initialisation
        torch.testing.assert_close(marl_init[name.replace(".default.", ".solo.")], trl_init[name], rtol=0, atol=0)
    moved = max((trl_final[n] - trl_init[n]).abs().max().item() for n in trl_final)
    assert moved > 1e-3, "the update is too small for the comparison to mean anything"
    for name in trl_final:
        torch.testing.assert_close(as_trl[name], trl_final[name], rtol=0, atol=1e-6)
    assert len(marl_losses) == len(trl_losses) == 2
    assert marl_losses == pytest.approx(trl_losses, abs=1e-6)
    assert marl_rewards == pytest.approx(trl_rewards, abs=1e-6)
