"""ATGRPOTrainer on the shared trainer stack: regimes, frozen agents, side by side with MAGRPO, the CLI, bad config;
and a short run on the real default model."""

import subprocess
import sys

import pytest
import torch
from datasets import Dataset
from test_trainer import lora_params, randomize_adapters
from tiny_run import TINY_RUN

from trl_marl import ATGRPOConfig, ATGRPOTrainer, MAGRPOConfig, MAGRPOTrainer, Task, TeamConfig, TeamTrainer
from trl_marl.tasks.toy import ReachTarget

AGENTS = [{"name": "writer", "system_prompt": "Write something."}, {"name": "editor", "system_prompt": "Edit it."}]


def length_reward(prompts, completions, state, **kwargs):
    """Varies with what was said (random tiny-model text), and reads the environment state."""
    return [len(c["writer"]) / 10 + len(c["editor"]) / 20 + len(s["said"]) for c, s in zip(completions, state)]


class Notebook(Task):
    """A task with a state: what was said so far, in order."""

    name = "notebook"
    agents = AGENTS
    num_turns = 2
    scheduler = "sequential"
    reward_funcs = [length_reward]
    local_reward_funcs = {"editor": [lambda prompts, completions, **kwargs: [0.1 * len(c) for c in completions]]}

    def dataset(self, split="train"):
        topics = ["rain", "tea", "maps", "owls"]
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Write about {t}."}] for t in topics]})

    def reset(self, example):
        return {"said": []}

    def step(self, state, agent, action, turn):
        state["said"].append(agent)
        return state


def config(config_class, tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
        max_steps=2,
        **TINY_RUN,
        seed=3,
    )
    values.update(overrides)
    return config_class.for_task(Notebook(), **values)


class Batches:
    """Records each generated batch's real rows."""

    def __init__(self, trainer):
        self.batches = []
        generate = trainer._generate_and_score_completions

        def recorded(inputs):
            output = generate(inputs)
            self.batches.append({key: output[key][~output["is_padding"]] for key in ("agent_index", "turn_index")})
            return output

        trainer._generate_and_score_completions = recorded


@pytest.mark.parametrize("trainer_class", [MAGRPOTrainer, ATGRPOTrainer])
def test_the_same_task_trains_with_either_algorithm_by_changing_the_config(tiny_model_dir, tmp_path, trainer_class):
    config_class = ATGRPOConfig if trainer_class is ATGRPOTrainer else MAGRPOConfig
    trainer = trainer_class(tiny_model_dir, args=config(config_class, tmp_path), task=Notebook())
    randomize_adapters(trainer)
    before = {agent["name"]: lora_params(trainer.model, agent["name"]) for agent in AGENTS}
    batches = Batches(trainer)
    trainer.train()
    for agent, params in before.items():
        after = lora_params(trainer.model, agent)
        assert any(not torch.equal(params[n], after[n]) for n in params), f"adapter {agent} did not change"
    rows = batches.batches[0]
    if trainer_class is ATGRPOTrainer:
        # 1 problem per step (4 copies / G=2 ... 2 problems), 2 turns, 2 agents, G candidates each: 2 × 2 × 2 × 2 rows.
        assert len(rows["agent_index"]) == 16
        logged = trainer.state.log_history[0]
        for key in ("turns/1/agents/editor/group_reward_std", "turns/0/agents/writer/chosen_reward",
                    "turns/0/agents/editor/frac_reward_zero_std", "agents/editor/local_reward"):  # fmt: skip
            assert key in logged, key
    else:
        assert "turns/1/reward" in trainer.state.log_history[0]


def test_shared_regime_trains_one_adapter_from_every_agents_samples(tiny_model_dir, tmp_path):
    trainer = ATGRPOTrainer(
        tiny_model_dir, args=config(ATGRPOConfig, tmp_path, adapter_mode="shared", max_steps=1), task=Notebook()
    )
    assert list(trainer.model.peft_config) == ["team"]
    randomize_adapters(trainer)
    before = lora_params(trainer.model, "team")
    batches = Batches(trainer)
    trainer.train()
    after = lora_params(trainer.model, "team")
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert set(batches.batches[0]["agent_index"].tolist()) == {0, 1}


@pytest.mark.parametrize("adapter_mode", ["per_agent", "shared"])
def test_a_frozen_agent_acts_but_does_not_train(tiny_model_dir, tmp_path, adapter_mode):
    args = config(ATGRPOConfig, tmp_path, frozen_agents=["editor"], adapter_mode=adapter_mode)
    trainer = ATGRPOTrainer(tiny_model_dir, args=args, task=Notebook())
    randomize_adapters(trainer)
    adapters = ["team"] if adapter_mode == "shared" else ["writer", "editor"]
    before = {name: lora_params(trainer.model, name) for name in adapters}
    batches = Batches(trainer)
    trainer.train()
    for name in adapters:
        changed = any(not torch.equal(before[name][n], p) for n, p in lora_params(trainer.model, name).items())
        assert changed is (name != "editor"), name
    assert all(set(batch["agent_index"].tolist()) == {0} for batch in batches.batches)
    assert "turns/0/agents/editor/chosen_reward" in trainer.state.log_history[0]  # it acted and was scored


def test_at_grpo_config_rejects_what_does_not_apply_naming_the_field(tmp_path):
    with pytest.raises(ValueError, match="`joint_mode='cross'` does not apply to AT-GRPO"):
        config(ATGRPOConfig, tmp_path, joint_mode="cross")
    with pytest.raises(ValueError, match="`discount=0.9` does not apply"):
        config(ATGRPOConfig, tmp_path, discount=0.9)
    with pytest.raises(ValueError, match="`continuation` must be one of"):
        config(ATGRPOConfig, tmp_path, continuation="best")
    with pytest.raises(ValueError, match=r"`frozen_agents` names \['critic'\]"):
        config(ATGRPOConfig, tmp_path, frozen_agents=["critic"])
    with pytest.raises(ValueError, match="freezes every agent"):
        config(MAGRPOConfig, tmp_path, frozen_agents=["writer", "editor"])
    with pytest.raises(ValueError, match="2 × 2 agents × num_turns=2 = 8 candidates"):
        config(ATGRPOConfig, tmp_path, max_joint_actions=7)


def test_at_grpo_configs_written_before_the_split_still_load(tmp_path):
    # `joint_mode="aligned"` and `discount=1.0` were AT-GRPO's accepted values when it inherited them: they change
    # nothing, so they are dropped; the fields do not exist on the AT-GRPO config.
    args = config(ATGRPOConfig, tmp_path, joint_mode="aligned", discount=1.0)
    assert not hasattr(args, "joint_mode") and not hasattr(args, "discount")
    assert args.team_reward_weight == 1.0


def test_the_cli_applies_the_same_rule_to_yaml_keys_and_flags(tmp_path):
    from trl_marl.cli.train import UsageError, parse_train_config

    path = tmp_path / "at_grpo.yaml"
    base = f"algorithm: at_grpo\ntask: reach_target\noutput_dir: {tmp_path / 'out'}\nuse_cpu: true\nbf16: false\n"
    path.write_text(base + "joint_mode: aligned\ndiscount: 1\n")
    _, args = parse_train_config(str(path), ["--discount", "1.0"])
    assert type(args) is ATGRPOConfig and not hasattr(args, "discount")
    with pytest.raises(UsageError, match="`joint_mode='cross'` does not apply to AT-GRPO: each group holds"):
        parse_train_config(str(path), ["--joint_mode", "cross"])
    path.write_text(base + "discount: 0.9\n")
    with pytest.raises(UsageError, match=f"{path}: `discount=0.9` does not apply to AT-GRPO"):
        parse_train_config(str(path))


def test_the_shared_bases_say_which_class_to_use(tiny_model_dir, tmp_path):
    from trl_marl.config import ActorCriticConfig

    for shared in (TeamConfig, ActorCriticConfig):
        with pytest.raises(TypeError, match=f"{shared.__name__} is a base.*MAGRPOConfig, ATGRPOConfig, IACConfig or"):
            shared(output_dir=str(tmp_path), agents=["writer", "editor"])
    with pytest.raises(TypeError, match="TeamTrainer is a base.*use MAGRPOTrainer, ATGRPOTrainer, IACTrainer or"):
        TeamTrainer(tiny_model_dir, args=config(MAGRPOConfig, tmp_path), task=Notebook())


def test_each_trainer_takes_only_its_own_config(tiny_model_dir, tmp_path):
    with pytest.raises(TypeError, match="an ATGRPOConfig goes to ATGRPOTrainer"):
        MAGRPOTrainer(tiny_model_dir, args=config(ATGRPOConfig, tmp_path), task=Notebook())
    with pytest.raises(TypeError, match="must be a ATGRPOConfig"):
        ATGRPOTrainer(tiny_model_dir, args=config(MAGRPOConfig, tmp_path), task=Notebook())


@pytest.mark.slow
def test_cli_trains_at_grpo_when_the_config_says_so(tiny_model_dir, tmp_path):
    config_file = tmp_path / "team.yaml"
    config_file.write_text(
        f"algorithm: at_grpo\ntask: reach_target\nmodel_name_or_path: {tiny_model_dir}\n"
        f"output_dir: {tmp_path / 'out'}\n"
        "per_device_train_batch_size: 2\nnum_generations: 2\nmax_completion_length: 4\nmax_steps: 1\n"
        "team_reward_weight: 0.5\nuse_cpu: true\nreport_to: none\nsave_strategy: 'no'\nlogging_steps: 1\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "trl_marl.cli", "train", str(config_file)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "turns/1/agents/finisher/chosen_reward" in done.stdout + done.stderr
    assert (tmp_path / "out" / "mover" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_at_grpo_on_the_default_model_trains_every_agent_on_the_puzzle(default_model_dir, tmp_path):
    args = ATGRPOConfig.for_task(
        "reach_target",
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
    )
    task = ReachTarget()
    trainer = ATGRPOTrainer(default_model_dir, args=args, train_dataset=task.dataset().select(range(4)), task=task)
    before = {agent["name"]: lora_params(trainer.model, agent["name"]) for agent in task.agents}
    trainer.train()
    for agent, params in before.items():
        after = lora_params(trainer.model, agent)
        assert any(not torch.equal(params[n], after[n]) for n in params), f"adapter {agent} did not change"
    logged = trainer.state.log_history[0]
    assert 0.0 <= logged["episodes/success_rate"] <= 1.0
    assert 0.0 <= logged["episodes/team_reward"] <= 1.0  # reach_target_reward's range, of the final joint actions
    assert logged["num_samples"] == 4 * 2 * 2  # one problem: G candidates × 2 agents × 2 turns
