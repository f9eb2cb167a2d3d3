"""MAGRPOTrainer on a tiny random model: adapters, routing, batched generation, metrics, eval, saving, bad input."""

import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from peft import PeftModel
from tiny_run import TINY_RUN
from transformers import AutoModelForCausalLM, TrainerCallback

from trl_marl import MAGRPOConfig, MAGRPOTrainer, RewardFunctionError

AGENTS = [{"name": "concise", "system_prompt": "Answer in a few words."}, {"name": "detailed"}]
PROMPTS = ["Name a colour.", "Name a fruit.", "Count to three.", "Say hello."]


def length_ratio_reward(prompts, completions, **kwargs):
    return [len(c["detailed"]) / (1.0 + len(c["concise"])) for c in completions]


def make_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        agents=AGENTS,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=2,
        **TINY_RUN,
        seed=3,
    )
    values.update(overrides)
    return MAGRPOConfig(**values)


def make_trainer(model_dir, tmp_path, reward=length_ratio_reward, conversational=True, **overrides):
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] if conversational else PROMPTS
    dataset = Dataset.from_dict({"prompt": prompts, "topic": ["colour", "fruit", "count", "greet"]})
    return MAGRPOTrainer(model_dir, reward, args=make_config(tmp_path, **overrides), train_dataset=dataset)


def lora_params(model, adapter):
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{adapter}." in n}


def randomize_adapters(trainer, seed=0):
    """Fresh LoRA B is zero, so every agent starts as the base model; make the agents differ."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)


@pytest.mark.parametrize(
    "joint_mode, checkpointing",
    [("aligned", {}), ("cross", {}), ("aligned", {"use_reentrant": True}), ("aligned", {"use_reentrant": False})],
    ids=["aligned", "cross", "checkpointed-reentrant", "checkpointed-non-reentrant"],
)
def test_every_adapter_trains_and_base_stays_frozen(tiny_model_dir, tmp_path, joint_mode, checkpointing):
    overrides = dict(gradient_checkpointing=True, gradient_checkpointing_kwargs=checkpointing) if checkpointing else {}
    trainer = make_trainer(tiny_model_dir, tmp_path, joint_mode=joint_mode, **overrides)
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    adapters_before = {agent: lora_params(trainer.model, agent) for agent in ("concise", "detailed")}
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if "lora_" in n)
    trainer.train()
    for agent, before in adapters_before.items():
        after = lora_params(trainer.model, agent)
        assert before, f"no LoRA parameters for {agent}"
        assert any(not torch.equal(before[n], after[n]) for n in before), f"adapter {agent} did not change"
    for name, param in trainer.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(base_before[name], param.detach()), f"base weight {name} changed"


def test_routing_is_cleared_after_training_so_set_adapter_works_again(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1)
    randomize_adapters(trainer)
    trainer.train()
    assert trainer.router.row_adapters is None
    model, inputs = trainer.model, torch.randint(100, 1000, (2, 5))
    outputs = {}
    for agent in ("concise", "detailed"):
        model.set_adapter(agent)
        outputs[agent] = model(input_ids=inputs).logits
    assert not torch.allclose(outputs["concise"], outputs["detailed"])


def test_samples_carry_agent_turn_and_group(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1)
    batch = [example for example in trainer.train_dataset.select(range(2)) for _ in range(4)]
    trainer.model.train()
    samples = trainer._generate_and_score_completions(batch)
    assert samples["prompt_ids"].size(0) == 16  # 8 prompt copies x 2 agents
    assert samples["agent_index"].tolist() == [0, 1] * 8
    assert samples["turn_index"].tolist() == [0] * 16
    assert samples["group_index"].tolist() == [0] * 8 + [1] * 8
    # Aligned: both agents' g-th completions share the joint action's advantage.
    advantages = samples["advantages"].view(8, 2)
    torch.testing.assert_close(advantages[:, 0], advantages[:, 1])
    assert samples["num_items_in_batch"].item() == samples["completion_mask"].sum().item()


def test_cross_mode_scores_every_combination(tiny_model_dir, tmp_path):
    seen = []

    def recording_reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return [float(len(c["concise"]) - len(c["detailed"])) for c in completions]

    trainer = make_trainer(tiny_model_dir, tmp_path, reward=recording_reward, joint_mode="cross", num_generations=2)
    batch = [example for example in trainer.train_dataset.select(range(2)) for _ in range(2)]
    trainer.model.train()
    samples = trainer._generate_and_score_completions(batch)
    assert len(seen) == 2 * 2**2  # two prompts, G^N joint actions each
    texts = trainer.processing_class.batch_decode(samples["completion_ids"], skip_special_tokens=True)
    first_group = {(c["concise"], c["detailed"]) for c in seen[:4]}
    assert first_group == {(texts[c], texts[d]) for c in (0, 2) for d in (1, 3)}


def test_each_row_uses_its_agents_adapter_in_training_forward(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path)
    randomize_adapters(trainer)
    model = trainer.model
    input_ids = torch.randint(100, 1000, (4, 7))
    mask = torch.ones_like(input_ids)
    trainer._rows_agent_index = torch.tensor([0, 1, 1, 0])
    mixed, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, mask, 3)
    trainer._rows_agent_index = None
    trainer.router.route(None)
    for agent in ("concise", "detailed"):
        model.set_adapter(agent)
        alone, _, _ = trainer._get_per_token_logps_and_entropies(model, input_ids, mask, 3)
        rows = [0, 3] if agent == "concise" else [1, 2]
        torch.testing.assert_close(mixed[rows], alone[rows], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mixed[[0, 3]], mixed[[1, 2]].flip(0)), "agents should differ"


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_replays_each_row_with_its_adapter(tiny_model_dir, tmp_path, use_reentrant):
    """Reentrant checkpointing runs the first forward without gradients and replays it in the backward: the replay must
    not reuse adapter weights concatenated (and detached) in the first forward, or no LoRA weight gets a gradient."""
    trainer = make_trainer(tiny_model_dir, tmp_path)
    randomize_adapters(trainer)
    trainer.model.train()
    batch = [example for example in trainer.train_dataset.select(range(2)) for _ in range(4)]
    samples = trainer._generate_and_score_completions(batch)
    trainer.router.route(["detailed"] * 16)  # a stale routing must not leak into the loss
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() otherwise

    def gradients(checkpointing):
        model = trainer.model
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        else:
            model.gradient_checkpointing_disable()
        model.zero_grad()
        trainer._compute_loss(model, samples).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert any(".concise." in n for n in plain) and any(".detailed." in n for n in plain)
    assert sorted(checkpointed) == sorted(plain), "a LoRA weight got no gradient under checkpointing"
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-6)


ONE_STEP = """
import sys
from trl_marl import MAGRPOConfig, MAGRPOTrainer
args = MAGRPOConfig.for_task(
    "explain", output_dir=sys.argv[2], max_steps=1, num_generations=2, per_device_train_batch_size=2,
    max_completion_length=4, report_to="none", save_strategy="no", use_cpu=True,
)
MAGRPOTrainer(sys.argv[1], args=args, task="explain").train()
"""


@pytest.mark.slow
def test_a_training_run_prints_no_gradient_checkpointing_deprecation(tiny_model_dir, tmp_path):
    """transformers 5 deprecates the `gradient_checkpointing` names, which TRL 1.16 and PEFT still use on the user's
    behalf (checkpointing is on: TRL's default). pytest filters those warnings, so the run is a subprocess with
    Python's default warning filters (`-W default`), where each would be printed once."""
    command = [sys.executable, "-W", "default", "-c", ONE_STEP, tiny_model_dir, str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "train_runtime" in result.stdout
    assert [line for line in result.stderr.splitlines() if "checkpointing" in line] == []


def test_one_generate_call_gives_each_row_its_agents_greedy_output(tiny_model_dir, tmp_path):
    agents = [{"name": "left"}, {"name": "right"}, {"name": "third"}]
    trainer = make_trainer(
        tiny_model_dir, tmp_path, agents=agents, generation_kwargs={"do_sample": False}, max_completion_length=5
    )
    randomize_adapters(trainer, seed=1)
    model, unwrapped_generate = trainer.model, trainer.model.generate
    calls = []
    trainer.model.generate = lambda *a, **k: calls.append(k["input_ids"].size(0)) or unwrapped_generate(*a, **k)
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS[:2]]
    team_prompts = [p for p in prompts for _ in agents]
    _, team_ids, _ = trainer.team_generation.generate(team_prompts, [0, 1, 2, 0, 1, 2], num_generations=4)
    assert calls == [6], "the whole team must be generated in one call"
    assert trainer.router.row_adapters is None, "routing is cleared after the call"
    for index, agent in enumerate(agents):
        model.set_adapter(agent["name"])
        _, alone_ids, *_ = trainer._generate(prompts)
        assert [team_ids[r * 3 + index] for r in range(2)] == alone_ids
    assert team_ids[0] != team_ids[1] or team_ids[1] != team_ids[2], "agents should not all answer alike"


def test_standard_prompts_go_through_the_chat_template(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, conversational=False, max_steps=1)
    batch = [example for example in trainer.train_dataset.select(range(1)) for _ in range(4)]
    trainer.model.train()
    samples = trainer._generate_and_score_completions(batch)
    text = trainer.processing_class.decode(samples["prompt_ids"][0], skip_special_tokens=False)
    assert "<|im_start|>system\nAnswer in a few words.<|im_end|>" in text
    assert "<|im_start|>user\nName a colour.<|im_end|>" in text
    trainer.train()
    assert trainer.state.global_step == 1


def test_metrics_are_logged_per_agent(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1)
    trainer.train()
    logs = trainer.state.log_history[0]
    for key in ("reward", "reward_std", "rewards/length_ratio_reward/mean", "frac_reward_zero_std", "loss"):
        assert key in logs, key
    for agent in ("concise", "detailed"):
        for metric in ("completion_length", "clipped_ratio", "advantage_mean", "advantage_std"):
            assert f"agents/{agent}/{metric}" in logs
        assert 1 <= logs[f"agents/{agent}/completion_length"] <= 6


def test_reward_kwargs_carry_dataset_columns_and_turn(tiny_model_dir, tmp_path):
    received = {}

    def inspecting_reward(prompts, completions, completion_ids, topic, turn, **kwargs):
        received.update(topic=topic, turn=turn, ids=completion_ids, prompts=prompts)
        return [1.0] * len(prompts)

    trainer = make_trainer(tiny_model_dir, tmp_path, reward=inspecting_reward, max_steps=1)
    trainer.train()
    assert set(received["topic"]) <= {"colour", "fruit", "count", "greet"}
    assert received["turn"] == [0] * len(received["topic"])
    assert set(received["ids"][0]) == {"concise", "detailed"}
    assert isinstance(received["ids"][0]["concise"], list)


def test_evaluate_logs_team_reward_under_eval(tiny_model_dir, tmp_path):
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    eval_dataset = Dataset.from_dict({"prompt": prompts[:2]})
    args = make_config(tmp_path, per_device_eval_batch_size=4, num_generations_eval=2)
    trainer = MAGRPOTrainer(
        tiny_model_dir,
        length_ratio_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        eval_dataset=eval_dataset,
    )
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and "eval_agents/concise/completion_length" in metrics
    assert metrics["eval_reward"] >= 0.0


def test_save_model_writes_one_peft_adapter_per_agent(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1)
    trainer.train()
    trainer.save_model(str(tmp_path / "team"))
    for agent in ("concise", "detailed"):
        assert (tmp_path / "team" / agent / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "team" / "concise"), adapter_name="concise")
    reloaded.load_adapter(str(tmp_path / "team" / "detailed"), adapter_name="detailed")
    trained = lora_params(trainer.model, "detailed")
    for name, value in lora_params(reloaded, "detailed").items():
        torch.testing.assert_close(value, trained[name])


def test_checkpoint_holds_every_agent_and_resuming_trains_every_agent(tiny_model_dir, tmp_path):
    settings = dict(max_steps=2, lr_scheduler_type="constant")
    trainer = make_trainer(tiny_model_dir, tmp_path, save_strategy="steps", save_steps=1, **settings)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    for agent in ("concise", "detailed"):
        assert (checkpoint / agent / "adapter_model.safetensors").is_file()
    assert (checkpoint / "optimizer.pt").is_file()

    class RecordResumedAdapters(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.loaded = {agent: lora_params(model, agent) for agent in ("concise", "detailed")}

    resumed = make_trainer(tiny_model_dir, tmp_path, save_strategy="no", **settings)
    record = RecordResumedAdapters()
    resumed.add_callback(record)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 2
    for agent, loaded in record.loaded.items():
        after = lora_params(resumed.model, agent)
        assert any(not torch.equal(loaded[n], after[n]) for n in loaded), f"{agent} did not train after resuming"


def test_shared_adapter_mode_trains_one_adapter(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, adapter_mode="shared", max_steps=1)
    assert list(trainer.model.peft_config) == ["team"]
    before = lora_params(trainer.model, "team")
    trainer.train()
    after = lora_params(trainer.model, "team")
    assert any(not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        (lambda prompts, completions, **kw: 1 / 0, "raised ZeroDivisionError"),
        (lambda prompts, completions, **kw: [1.0], "returned 1 rewards for 4 joint actions"),
        (lambda prompts, completions, **kw: [float("nan")] * len(prompts), "returned nan for joint action 0"),
    ],
    ids=["raises", "wrong-length", "nan"],
)
def test_bad_team_reward_is_an_error_naming_the_function(tiny_model_dir, tmp_path, reward, message):
    def broken_team_reward(prompts, completions, **kwargs):
        return reward(prompts, completions, **kwargs)

    trainer = make_trainer(tiny_model_dir, tmp_path, reward=broken_team_reward, max_steps=1)
    with pytest.raises(RewardFunctionError, match="broken_team_reward") as error:
        trainer.train()
    assert message in str(error.value)


def test_peft_model_without_the_agents_adapters_is_rejected(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=2, task_type="CAUSAL_LM"))
    dataset = Dataset.from_dict({"prompt": PROMPTS})
    with pytest.raises(ValueError, match=r"missing \['concise', 'detailed'\]"):
        MAGRPOTrainer(model, length_ratio_reward, args=make_config(tmp_path), train_dataset=dataset)


def test_args_must_name_the_team(tiny_model_dir):
    with pytest.raises(TypeError, match="MAGRPOConfig"):
        MAGRPOTrainer(tiny_model_dir, length_ratio_reward, args=None, train_dataset=Dataset.from_dict({"prompt": []}))


def test_free_memory_goes_back_to_the_system_around_each_rollout_and_once_after_every_optimizer_step(
    tiny_model_dir, tmp_path, monkeypatch
):
    from trl_marl.memory import host
    from trl_marl.trainers import team_trainer

    releases = []
    monkeypatch.setattr(host, "release_free_memory", lambda: releases.append("step"))  # the callback's
    monkeypatch.setattr(team_trainer, "release_free_memory", lambda: releases.append("rollout"))

    class SeenAtStepEnd(TrainerCallback):  # added after the trainer's own callbacks: runs after its release
        def __init__(self):
            self.seen = []

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.append((state.global_step, list(releases)))

    # three micro-batches per optimizer step (one generation): one release per step, not per backward (nor per
    # micro-batch's end), and one before and one after each rollout
    trainer = make_trainer(tiny_model_dir, tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=3)
    seen = SeenAtStepEnd()
    trainer.add_callback(seen)
    trainer.train()
    step = ["rollout", "rollout", "step"]
    assert seen.seen == [(1, step), (2, step + step)]
