"""IACTrainer and MAACTrainer on a tiny random model: actors and critics train and the base does not, a critic held at
zero gives MAGRPO's `baseline="none"` training, each critic reads what it should, and checkpoints carry the critics."""

import pytest
import torch
from datasets import Dataset
from tiny_run import TINY_RUN

from trl_marl import IACConfig, IACTrainer, MAACConfig, MAACTrainer, MAGRPOConfig, MAGRPOTrainer
from trl_marl.rollouts.trajectory_rollout import critic_inputs, trajectories
from trl_marl.trainers.actor_critic_trainer import VALUE_HEADS_FILE, value_loss, zscore

AGENTS = [{"name": "writer", "system_prompt": "Write."}, {"name": "checker", "system_prompt": "Check."}]
PROMPTS = ["Name a colour.", "Name a fruit.", "Count to three.", "Say hello."]
KINDS = {"iac": (IACConfig, IACTrainer), "maac": (MAACConfig, MAACTrainer)}


def team_reward(prompts, completions, **kwargs):
    return [len(c["checker"]) / (1.0 + len(c["writer"])) for c in completions]


def settings(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        agents=AGENTS,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        **TINY_RUN,
        seed=3,
    )
    values.update(overrides)
    return values


def dataset():
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})


def make_trainer(kind, model_dir, tmp_path, transition=None, **overrides):
    config_class, trainer_class = KINDS[kind]
    args = config_class(**settings(tmp_path, **overrides))
    return trainer_class(model_dir, team_reward, args=args, train_dataset=dataset(), transition=transition)


def weights(model, marker):
    return {n: p.detach().clone() for n, p in model.named_parameters() if marker(n)}


def changed(before, model):
    after = dict(model.named_parameters())
    return [n for n in before if not torch.equal(before[n], after[n].detach())]


@pytest.mark.parametrize("kind", ["iac", "maac"])
def test_actors_and_critics_train_and_the_base_stays_frozen_over_two_turns(tiny_model_dir, tmp_path, kind):
    trainer = make_trainer(kind, tiny_model_dir, tmp_path, num_turns=2)
    model = trainer.model
    critics = ["critic_writer", "critic_checker"] if kind == "iac" else ["critic"]
    assert trainer.critic_names == critics and set(model.peft_config) == {"writer", "checker", *critics}
    names = ["writer", "checker", *critics]
    adapters = {name: weights(model, lambda n, name=name: f".{name}." in n) for name in names}
    heads = weights(model, lambda n: n.startswith("value_heads."))
    base = weights(model, lambda n: "lora_" not in n and not n.startswith("value_heads."))
    trainer.train()
    for name, before in adapters.items():
        assert before and changed(before, model), f"adapter {name} did not change"
    assert len(changed(heads, model)) == len(heads) == 2 * len(critics)  # every head's weight and bias
    assert not changed(base, model)
    logged = [log for log in trainer.state.log_history if "critic/value_loss" in log]
    assert logged and all(log["critic/value_loss"] >= 0 for log in logged)
    # The optimizer holds the critics in a group of their own, at the learning rate (no `critic_learning_rate`).
    critic_group = trainer.optimizer.param_groups[-1]
    assert {id(p) for p in critic_group["params"]} == {id(p) for p in trainer.critic_parameters()}


def own_answer_only(prompt, joint_action, **kwargs):
    """Each agent's next prompt holds its own answer, not its teammate's."""
    return [[{"role": "user", "content": f"You said: {joint_action[a['name']]}. Again."}] for a in AGENTS]


@pytest.mark.parametrize("kind", ["iac", "maac"])
def test_maacs_value_changes_with_a_teammates_action_and_iacs_only_with_its_agents_own(kind, tiny_model_dir, tmp_path):
    trainer = make_trainer(
        kind, tiny_model_dir, tmp_path, transition=own_answer_only, num_turns=2, scheduler="parallel_blind"
    )
    trainer.model.train()
    rollout = trainer._rollout([{"prompt": [{"role": "user", "content": PROMPTS[0]}]}] * 2, 2)
    chain = next(chain for chain in trajectories(rollout.joint_actions) if len(chain) == 2)
    first, j = rollout.joint_actions[chain[0]], chain[1]  # a turn-0 joint action and the one after it
    writer, checker = first.completions["writer"].strip(), first.completions["checker"].strip()
    assert writer and checker and writer not in checker and checker not in writer
    tokenizer = trainer._tokenizer

    def value(text, critic):
        return trainer.critic_values([tokenizer(text, add_special_tokens=False)["input_ids"]], [critic]).item()

    if kind == "maac":  # one critic over every agent's input: either agent's earlier answer moves its value
        text = critic_inputs(rollout, "maac", ["writer", "checker"])[j][0]
        assert writer in text and checker in text
        for answer in (writer, checker):
            assert value(text.replace(answer, "zebra"), "critic") != value(text, "critic")
    else:  # the writer's critic reads the writer's own input: the checker's answer is not in it, its own moves it
        ids = trainer._critic_input_ids(rollout)[j][0]
        text = tokenizer.decode(ids)
        assert writer in text and checker not in text
        assert value(text, "critic_writer") == pytest.approx(trainer.critic_values([ids], ["critic_writer"]).item())
        assert value(text.replace(writer, "zebra"), "critic_writer") != value(text, "critic_writer")


def test_a_critic_held_at_zero_trains_the_actors_exactly_as_magrpo_without_a_baseline(tiny_model_dir, tmp_path):
    common = dict(max_steps=3, logging_steps=1, scale_rewards="none", num_turns=1)
    magrpo = MAGRPOTrainer(
        tiny_model_dir,
        team_reward,
        args=MAGRPOConfig(**settings(tmp_path / "magrpo", baseline="none", **common)),
        train_dataset=dataset(),
    )
    magrpo.train()  # each trainer trains right after its construction, which seeds torch's generators
    iac = make_trainer(
        "iac",
        tiny_model_dir,
        tmp_path / "iac",
        discount=1.0,
        gae_lambda=1.0,
        normalize_advantages=False,
        value_loss_coef=0.0,  # the critics never move
        **common,
    )
    with torch.no_grad():
        for head in iac.value_heads.values():
            head.linear.weight.zero_()
    iac.train()
    losses = [[log["loss"] for log in t.state.log_history if "loss" in log] for t in (magrpo, iac)]
    assert len(losses[0]) == 3 and losses[0] == pytest.approx(losses[1], abs=1e-6)
    assert any(loss != 0 for loss in losses[0])
    for agent in ("writer", "checker"):
        ours = weights(iac.model, lambda n, agent=agent: f".{agent}." in n)
        theirs = weights(magrpo.model, lambda n, agent=agent: f".{agent}." in n)
        assert ours.keys() == theirs.keys()
        assert all(torch.allclose(ours[n], theirs[n], atol=1e-6) for n in ours), agent
    assert all(float(head.linear.weight.abs().sum()) == 0 for head in iac.value_heads.values())


def test_the_critics_learning_rate_is_their_groups_and_the_scheduler_scales_it(tiny_model_dir, tmp_path):
    trainer = make_trainer("maac", tiny_model_dir, tmp_path, max_steps=1, critic_learning_rate=1e-3)
    trainer.create_optimizer_and_scheduler(num_training_steps=4)
    groups = trainer.optimizer.param_groups
    assert groups[-1]["lr"] == pytest.approx(1e-3) and groups[0]["lr"] == pytest.approx(5e-2)
    actor = {id(p) for group in groups[:-1] for p in group["params"]}
    assert not actor & {id(p) for p in trainer.critic_parameters()}


def test_a_checkpoint_carries_the_critics_and_a_resumed_run_equals_the_uninterrupted_one(tiny_model_dir, tmp_path):
    common = dict(max_steps=4, save_strategy="steps", save_steps=2, logging_steps=1)
    full = make_trainer("iac", tiny_model_dir, tmp_path / "full", **common)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-2"
    assert (checkpoint / VALUE_HEADS_FILE).exists() and (checkpoint / "critic_writer").is_dir()
    resumed = make_trainer("iac", tiny_model_dir, tmp_path / "resumed", **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    every = weights(full.model, lambda n: "lora_" in n or n.startswith("value_heads."))
    again = dict(resumed.model.named_parameters())
    assert every and all(torch.allclose(every[n], again[n].detach(), atol=1e-6) for n in every)


def test_resuming_from_a_checkpoint_without_value_heads_is_refused_and_names_the_file(tiny_model_dir, tmp_path):
    trainer = make_trainer("iac", tiny_model_dir, tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    (checkpoint / VALUE_HEADS_FILE).unlink()
    again = make_trainer("iac", tiny_model_dir, tmp_path, max_steps=2)
    with pytest.raises(FileNotFoundError, match=VALUE_HEADS_FILE):
        again.train(resume_from_checkpoint=str(checkpoint))
    assert (checkpoint / "critic_writer").is_dir()  # nothing of the checkpoint was touched


def test_the_value_loss_is_half_the_squared_error_and_clipping_takes_the_larger():
    values, old, targets = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 2.0])
    assert value_loss(values, old, targets, None).item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    # clipped to within 0.2 of the old value: 0.2 (row 0: (1-0)² > (0.2-0)², keeps 1) and 0.0 (row 1: keeps 4)
    assert value_loss(values, old, targets, 0.2).item() == pytest.approx(0.5 * (1.0 + 4.0) / 2)
    values = torch.tensor([1.5, 1.0])  # row 1 clipped to 0.2: (0.2 - 2)² = 3.24 > (1 - 2)² = 1
    assert value_loss(values, old, targets, 0.2).item() == pytest.approx(0.5 * (1.5**2 + 3.24) / 2)


def test_zscore_centres_and_scales_each_column():
    advantages = torch.tensor([[1.0, 10.0], [3.0, 10.0]])
    normalized = zscore(advantages)
    assert normalized[:, 0].tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-3)
    assert normalized[:, 1].tolist() == [0.0, 0.0]
    assert zscore(torch.tensor([[2.0]])).tolist() == [[0.0]]


def test_the_configs_refuse_a_baseline_and_out_of_range_settings_by_name(tmp_path):
    with pytest.raises(ValueError, match="`baseline='none'` does not apply to IAC"):
        IACConfig(**settings(tmp_path, baseline="none"))
    with pytest.raises(ValueError, match="`gae_lambda` must be a number in"):
        MAACConfig(**settings(tmp_path, gae_lambda=1.5))
    with pytest.raises(ValueError, match="`value_clip_range` must be a positive number or None"):
        MAACConfig(**settings(tmp_path, value_clip_range=0))
    with pytest.raises(ValueError, match="`joint_mode='cross'` does not apply to MAAC"):
        MAACConfig(**settings(tmp_path, joint_mode="cross"))
    with pytest.raises(TypeError, match="MAACConfig naming the agents, got IACConfig.*goes to IACTrainer"):
        MAACTrainer("unused", team_reward, args=IACConfig(**settings(tmp_path)))


def test_an_optimizer_given_without_the_critics_is_refused(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="does not hold the critics' parameters.*leave `optimizers` out"):
        args = IACConfig(**settings(tmp_path))
        IACTrainer(model, team_reward, args=args, train_dataset=dataset(), optimizers=(optimizer, None))


def test_trl_marl_train_builds_the_actor_critic_configs_and_points_a_critic_field_to_them(tmp_path):
    from trl_marl.cli.train import UsageError, algorithm_classes, parse_train_config

    path = tmp_path / "maac.yaml"
    common = f"output_dir: {tmp_path / 'out'}\nagents: [writer, checker]\nuse_cpu: true\n"
    path.write_text(f"algorithm: maac\n{common}gae_lambda: 0.5\n")
    script_args, args = parse_train_config(str(path), ["--value_loss_coef", "0.3"], require_data=False)
    assert script_args.algorithm == "maac" and type(args) is MAACConfig
    assert (args.gae_lambda, args.value_loss_coef) == (0.5, 0.3)
    assert algorithm_classes("iac") == (IACConfig, IACTrainer)
    path.write_text(f"{common}gae_lambda: 0.5\n")  # magrpo's
    with pytest.raises(UsageError, match=r"'gae_lambda' \(a field of iac: set `algorithm: iac`\)"):
        parse_train_config(str(path), require_data=False)


def test_trl_marl_estimate_counts_each_critic_as_a_trained_adapter(tiny_model_dir, tmp_path):
    from trl_marl.cli.command import estimate_config

    estimates = {}
    for algorithm in ("magrpo", "iac", "maac"):
        path = tmp_path / f"{algorithm}.yaml"
        path.write_text(f"algorithm: {algorithm}\noutput_dir: {tmp_path}\nagents: [writer, checker]\nuse_cpu: true\n")
        estimates[algorithm] = estimate_config(str(path), ["--model_name_or_path", tiny_model_dir])
    magrpo, iac, maac = estimates["magrpo"], estimates["iac"], estimates["maac"]
    per_adapter = magrpo.adapters // 2  # two agents' float32 adapters
    assert (iac.details["critic adapters"], maac.details["critic adapters"]) == (2, 1)
    assert (iac.adapters, maac.adapters) == (magrpo.adapters + 2 * per_adapter, magrpo.adapters + per_adapter)
    assert maac.gradients == magrpo.gradients * 3 // 2 and iac.gradients == magrpo.gradients * 2
    assert maac.optimizer_states == magrpo.optimizer_states * 3 // 2
    assert maac.saved_activations == magrpo.saved_activations  # the routed terms count the agents' adapters only


def test_on_a_4bit_base_the_critic_trains_in_the_agents_dtype_and_the_base_stays_frozen(tiny_model_dir, tmp_path):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is needed for 4-bit bases")
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    args = MAACConfig(**settings(tmp_path, max_steps=1, bf16=False))
    trainer = MAACTrainer(
        tiny_model_dir, team_reward, args=args, train_dataset=dataset(), quantization_config=quantization
    )
    model = trainer.model
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {torch.bfloat16}  # the agents' (TRL's cast on a quantized base) and the critic's alike
    critic = weights(model, lambda n: ".critic." in n)
    base = weights(model, lambda n: "lora_" not in n and not n.startswith("value_heads."))
    trainer.train()
    assert critic and changed(critic, model)
    assert not changed(base, model)
