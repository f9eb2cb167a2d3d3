"""KL to the base model with several adapters: every trained adapter trains, a frozen one does not, the reference is
the base model, and the logged KL equals the one computed by hand; the trainer refuses to train an adapter that has
silently stopped training."""

import pytest
import torch
from datasets import Dataset
from test_atgrpo_trainer import Notebook
from test_trainer import PROMPTS, lora_params, randomize_adapters
from tiny_run import TINY_RUN
from transformers import TrainerCallback

from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer

THREE_AGENTS = [{"name": "concise", "system_prompt": "Be brief."}, {"name": "detailed"}, {"name": "critic"}]


def lengths_reward(prompts, completions, **kwargs):
    """Varies with every agent's text, so that every group has non-zero advantages."""
    return [sum(len(text) * (i + 1) for i, text in enumerate(c.values())) / 10 for c in completions]


def common(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=5,
        max_steps=2,
        **TINY_RUN,
        beta=0.1,
        seed=5,
    )
    values.update(overrides)
    return values


def magrpo_trainer(model_dir, tmp_path, **overrides):
    args = MAGRPOConfig(**common(tmp_path, **{"agents": THREE_AGENTS[:2], **overrides}))
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    return MAGRPOTrainer(model_dir, lengths_reward, args=args, train_dataset=dataset)


def atgrpo_trainer(model_dir, tmp_path, **overrides):
    return ATGRPOTrainer(
        model_dir, args=ATGRPOConfig.for_task(Notebook(), **common(tmp_path, **overrides)), task=Notebook()
    )


class FirstLossInputs:
    """Records the inputs of the first loss computed (step 1: one micro-batch with `steps_per_generation=1`)."""

    def __init__(self, trainer):
        self.inputs = None
        compute_loss = trainer._compute_loss

        def recording(model, inputs):
            if self.inputs is None:
                self.inputs = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
            return compute_loss(model, inputs)

        trainer._compute_loss = recording


def completion_logps(model, inputs, rows):
    """Log-probs of the completion tokens of `rows` under the model as it is (PEFT's own forward)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)[rows]
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)[rows]
    length = inputs["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, -length - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, inputs["completion_ids"][rows].unsqueeze(-1))[..., 0]


def hand_computed_kl(trainer, start_weights, inputs):
    """The first step's KL term by hand, from the adapters as they were before training: each row's log-probs under
    its agent's adapter alone (PEFT's `set_adapter`), the base's with PEFT's adapters disabled, Schulman's k3
    `exp(ref − logp) − (ref − logp) − 1` (the importance weight is 1 at the first step), averaged over the completion
    tokens. Returns the KL and the base log-probs."""
    model = trainer.model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in start_weights:
                param.copy_(start_weights[name])
    rows = torch.arange(inputs["completion_ids"].size(0))
    with model.disable_adapter():
        base = completion_logps(model, inputs, rows)
    logps = torch.zeros_like(base)
    for agent in inputs["agent_index"].unique().tolist():
        model.set_adapter(trainer.agent_adapters[agent])
        agent_rows = rows[inputs["agent_index"] == agent]
        logps[agent_rows] = completion_logps(model, inputs, agent_rows)
    mask = inputs["completion_mask"].float()
    per_token = torch.exp(base - logps) - (base - logps) - 1
    return ((per_token * mask).sum() / mask.sum()).item(), base


@pytest.mark.parametrize(
    ("algorithm", "overrides", "trained", "frozen"),
    [
        ("magrpo", {}, ["concise", "detailed"], []),
        ("magrpo", {"agents": THREE_AGENTS}, ["concise", "detailed", "critic"], []),
        ("magrpo", {"agents": THREE_AGENTS, "frozen_agents": ["concise"]}, ["detailed", "critic"], ["concise"]),
        ("magrpo", {"agents": THREE_AGENTS, "adapter_mode": "shared", "frozen_agents": ["critic"]}, ["team"], []),
        ("atgrpo", {}, ["writer", "editor"], []),
        ("atgrpo", {"frozen_agents": ["writer"]}, ["editor"], ["writer"]),
    ],
    ids=["2-agents", "3-agents", "3-agents-first-frozen", "shared-adapter", "atgrpo", "atgrpo-first-frozen"],
)
def test_with_kl_every_trained_adapter_trains_against_the_base(tiny_model_dir, tmp_path, algorithm, overrides,
                                                                trained, frozen):  # fmt: skip
    make = magrpo_trainer if algorithm == "magrpo" else atgrpo_trainer
    trainer = make(tiny_model_dir, tmp_path, **overrides)
    randomize_adapters(trainer)  # every agent differs from the base: the KL is not zero
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n}
    recorder = FirstLossInputs(trainer)
    trainer.train()

    for adapter in trained:
        before, after = {n: start[n] for n in lora_params(trainer.model, adapter)}, lora_params(trainer.model, adapter)
        assert before and any(not torch.equal(before[n], after[n]) for n in before), f"{adapter} did not train"
        assert all(p.requires_grad for n, p in trainer.model.named_parameters() if f".{adapter}." in n)
    for adapter in frozen:
        after = lora_params(trainer.model, adapter)
        assert after and all(torch.equal(start[n], after[n]) for n in after), f"frozen {adapter} changed"
        assert not any(p.requires_grad for n, p in trainer.model.named_parameters() if f".{adapter}." in n)

    inputs = recorder.inputs
    expected_kl, base = hand_computed_kl(trainer, start, inputs)
    mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(inputs["ref_per_token_logps"][mask], base[mask], rtol=1e-4, atol=1e-4)
    assert expected_kl > 1e-3
    assert trainer.state.log_history[0]["kl"] == pytest.approx(expected_kl, rel=1e-3)


class CallSetAdapter(TrainerCallback):
    """What a user's callback (or any PEFT call ending in `set_adapter`) can do: leave one adapter trainable."""

    def __init__(self, trainer, adapter):
        self.trainer, self.adapter = trainer, adapter

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.trainer.model.set_adapter(self.adapter)


def test_an_adapter_that_stopped_requiring_grad_stops_training_naming_its_agent(tiny_model_dir, tmp_path):
    trainer = magrpo_trainer(tiny_model_dir, tmp_path, beta=0.0, agents=THREE_AGENTS)
    trainer.add_callback(CallSetAdapter(trainer, "detailed"))
    with pytest.raises(RuntimeError, match=r"adapter 'concise' of agents \['concise'\] no longer requires grad.*"
                       r"adapter 'critic' of agents \['critic'\] no longer requires grad.*set_adapter"):  # fmt: skip
        trainer.train()
    assert trainer.state.global_step == 1


def test_an_optimizer_without_an_agents_adapter_is_refused_naming_the_agent(tiny_model_dir, tmp_path):
    trainer = magrpo_trainer(tiny_model_dir, tmp_path, beta=0.0)
    concise_only = [p for n, p in trainer.model.named_parameters() if ".concise." in n]
    trainer.optimizer = torch.optim.AdamW(concise_only, lr=1e-2)  # as `optimizers=(...)` would give it
    with pytest.raises(RuntimeError, match=r"adapter 'detailed' of agents \['detailed'\] is not in the optimizer"):
        trainer.train()


def test_a_frozen_adapter_that_requires_grad_is_refused(tiny_model_dir, tmp_path):
    trainer = magrpo_trainer(tiny_model_dir, tmp_path, beta=0.0, agents=THREE_AGENTS, frozen_agents=["critic"])
    trainer.model.set_requires_grad(["critic"], requires_grad=True)
    with pytest.raises(RuntimeError, match=r"adapter 'critic' of frozen agents \['critic'\] requires grad"):
        trainer.train()
