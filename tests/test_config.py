"""Specification of `MAGRPOConfig`: the team is normalised and every bad setting is rejected at construction, before
any model is loaded, with a message that names the field, shows the value seen and says what is allowed."""

import pytest

from trl_marl.config import MAGRPOConfig


@pytest.fixture
def make_config(tmp_path):
    def make(**kwargs) -> MAGRPOConfig:
        kwargs.setdefault("agents", ["writer", "critic"])
        return MAGRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)

    return make


def error_message(make_config, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        make_config(**kwargs)
    return str(error.value)


# the team


def test_agents_given_as_names_get_empty_system_prompts(make_config):
    config = make_config(agents=["writer", "critic"])
    assert config.agents == [{"name": "writer", "system_prompt": ""}, {"name": "critic", "system_prompt": ""}]
    assert config.agent_names == ["writer", "critic"]
    assert config.num_agents == 2


def test_agents_given_as_dicts_keep_their_system_prompts(make_config):
    agents = [{"name": "concise", "system_prompt": "Answer in one sentence."}, {"name": "detailed"}]
    config = make_config(agents=agents)
    assert config.agents == [
        {"name": "concise", "system_prompt": "Answer in one sentence."},
        {"name": "detailed", "system_prompt": ""},
    ]
    assert config.agent_names == ["concise", "detailed"]


def test_agent_role_is_an_alias_of_system_prompt(make_config):
    config = make_config(agents=[{"name": "judge", "role": "You judge."}])
    assert config.agents == [{"name": "judge", "system_prompt": "You judge."}]
    assert config.num_agents == 1


@pytest.mark.parametrize("agents", [[], None])
def test_team_without_agents_is_rejected(make_config, agents):
    message = error_message(make_config, agents=agents)
    assert "`agents`" in message
    assert f"got {agents!r}" in message
    assert "at least one agent" in message


def test_single_agent_name_string_is_rejected(make_config):
    message = error_message(make_config, agents="writer")
    assert "`agents` must be a list" in message
    assert "'writer'" in message


def test_duplicate_agent_names_are_listed(make_config):
    message = error_message(make_config, agents=["writer", "critic", "writer"])
    assert "duplicate names ['writer']" in message
    assert "unique name" in message


@pytest.mark.parametrize("name", ["has space", "ref", "1st", "__base__"])
def test_invalid_agent_name_is_rejected(make_config, name):
    message = error_message(make_config, agents=["writer", name])
    assert "`agents[1]`" in message
    assert repr(name) in message
    assert "must start with a letter" in message
    assert "'ref'" in message  # the reserved names are listed


def test_agent_dict_with_unknown_key_is_rejected(make_config):
    message = error_message(make_config, agents=[{"name": "writer", "prompt": "Write."}])
    assert "`agents[0]`" in message
    assert "['prompt']" in message
    assert "'name', 'system_prompt', 'tools'" in message


# choices


def test_unknown_joint_mode_is_rejected(make_config):
    message = error_message(make_config, joint_mode="tree")
    assert "`joint_mode`" in message
    assert "'tree'" in message
    assert "['aligned', 'cross']" in message


def test_unknown_baseline_is_rejected(make_config):
    message = error_message(make_config, baseline="median")
    assert "`baseline`" in message
    assert "'median'" in message
    assert "['mean', 'rloo', 'max', 'none']" in message


def test_unknown_adapter_mode_is_rejected(make_config):
    message = error_message(make_config, adapter_mode="merged")
    assert "`adapter_mode`" in message
    assert "'merged'" in message
    assert "['per_agent', 'shared']" in message


# numbers


def test_single_generation_is_rejected(make_config):
    message = error_message(make_config, num_generations=1)
    assert "`num_generations`" in message
    assert "got 1" in message
    assert "at least 2" in message


def test_zero_lora_rank_is_rejected(make_config):
    message = error_message(make_config, lora_r=0)
    assert "`lora_r`" in message
    assert "got 0" in message
    assert "positive integer" in message


def test_lora_dropout_of_one_is_rejected(make_config):
    message = error_message(make_config, lora_dropout=1.0)
    assert "`lora_dropout`" in message
    assert "1.0" in message
    assert "[0, 1)" in message


def test_non_positive_max_joint_actions_is_rejected(make_config):
    message = error_message(make_config, max_joint_actions=0)
    assert "`max_joint_actions`" in message
    assert "got 0" in message
    assert "positive integer" in message


# joint actions


def test_aligned_joint_actions_per_prompt_is_num_generations(make_config):
    config = make_config(agents=["ann", "bob", "cy"], joint_mode="aligned", num_generations=4)
    assert config.joint_actions_per_prompt(config.num_generations) == 4


def test_cross_joint_actions_per_prompt_is_num_generations_to_the_num_agents(make_config):
    config = make_config(agents=["ann", "bob", "cy"], joint_mode="cross", num_generations=4)
    # 4**3
    assert config.joint_actions_per_prompt(config.num_generations) == 64


def test_too_many_joint_actions_are_rejected_with_what_to_lower(make_config):
    # 3 agents, G=8, cross: 8**3 = 512 > 256
    message = error_message(make_config, agents=["ann", "bob", "cy"], joint_mode="cross", num_generations=8)
    assert "512" in message
    assert "`max_joint_actions` (256)" in message
    assert "Lower `num_generations`" in message
    assert "joint_mode='aligned'" in message


def test_an_agent_name_inside_the_lora_prefix_is_rejected(make_config):
    message = error_message(make_config, agents=["a", "critic"])
    assert "`agents[0]` has name 'a'" in message and "'lora_'" in message


def test_the_lora_prefix_message_lists_exactly_the_names_it_refuses(make_config):
    pieces = ["a", "a_", "l", "lo", "lor", "lora", "lora_", "o", "or", "ora", "ora_", "r", "ra", "ra_"]
    message = error_message(make_config, agents=["lo", "critic"])
    assert f"Names that are a piece of 'lora_' are refused: {', '.join(pieces)}." in message
    for name in pieces:
        assert f"has name {name!r}, which is a piece of 'lora_'" in error_message(make_config, agents=[name, "b1"])
    # a name that only starts with, or contains, a piece of the prefix is a name like any other
    assert [a["name"] for a in make_config(agents=["lo1", "lora_writer", "alice"]).agents] == [
        "lo1", "lora_writer", "alice"
    ]  # fmt: skip


def test_the_bound_counts_every_turn_of_the_tree(make_config):
    config = make_config(num_generations=4, num_turns=3)
    # aligned: 4 + 16 + 64 joint actions, 64 leaves
    assert config.joint_actions_per_prompt(config.num_generations) == 84


def test_a_tree_larger_than_the_bound_fails_saying_its_size_and_what_to_lower(make_config):
    # cross, 2 agents, G=2, T=3: 4 + 16 + 64 = 84 joint actions, 64 = G^(N·T) leaves
    message = error_message(make_config, joint_mode="cross", num_generations=2, num_turns=3, max_joint_actions=50)
    assert "4 + 16 + 64 = 84 joint actions (64 leaves)" in message
    assert "`max_joint_actions` (50)" in message
    assert "Lower `num_turns` or `num_generations`" in message
    assert "joint_mode='aligned'" in message


def test_the_eval_tree_is_bounded_too(make_config):
    message = error_message(make_config, num_generations=2, num_generations_eval=8, num_turns=2, max_joint_actions=20)
    assert "num_generations_eval=8" in message and "8 + 64 = 72" in message


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_turns", 0), ("num_turns", 1.5), ("discount", 1.5), ("discount", -0.1), ("termination_threshold", "high")],
)
def test_bad_turn_settings_are_rejected_naming_the_field(make_config, field, value):
    message = error_message(make_config, **{field: value})
    assert f"`{field}`" in message and repr(value) in message


@pytest.mark.parametrize("value", [1.5, -0.1, "half", True])
def test_a_bad_share_of_failed_episodes_is_rejected_naming_the_field(make_config, value):
    message = error_message(make_config, episode_max_failed_fraction=value)
    assert "`episode_max_failed_fraction`" in message and repr(value) in message


def test_raising_max_joint_actions_accepts_the_large_cross_team(make_config):
    config = make_config(agents=["ann", "bob", "cy"], joint_mode="cross", num_generations=8, max_joint_actions=512)
    assert config.joint_actions_per_prompt(config.num_generations) == 512


# unsupported TRL settings


def test_vllm_server_mode_is_rejected_with_the_reason_and_colocate_is_accepted(make_config):
    # Issue 20: vLLM serves every agent's adapter as a LoRA from one colocated engine (tests/test_vllm.py); TRL's
    # server receives one merged policy.
    message = error_message(make_config, use_vllm=True, vllm_mode="server")
    assert "`vllm_mode='server'` is not supported" in message
    assert "Use `vllm_mode='colocate'`" in message
    config = make_config(use_vllm=True)
    assert config.use_vllm and config.vllm_mode == "colocate"


def test_continuous_batching_is_rejected(make_config):
    message = error_message(make_config, use_transformers_continuous_batching=True)
    assert "`use_transformers_continuous_batching=True` is not supported" in message
    assert "Set it to False" in message


def test_normalize_then_sum_aggregation_is_rejected(make_config):
    message = error_message(make_config, multi_objective_aggregation="normalize_then_sum")
    assert "`multi_objective_aggregation='normalize_then_sum'`" in message
    assert "'sum_then_normalize'" in message


def test_the_best_checkpoint_is_the_one_with_the_best_team_reward_unless_told_otherwise(tmp_path):
    """transformers ranks checkpoints by the eval loss when no metric is named: GRPO's surrogate loss, not a score."""
    settings = dict(
        output_dir=str(tmp_path), agents=["writer", "critic"], eval_strategy="steps", save_strategy="steps"
    )
    best = MAGRPOConfig(**settings, load_best_model_at_end=True, use_cpu=True)
    assert (best.metric_for_best_model, best.greater_is_better) == ("reward", True)
    named = MAGRPOConfig(**settings, load_best_model_at_end=True, metric_for_best_model="loss", use_cpu=True)
    assert (named.metric_for_best_model, named.greater_is_better) == ("loss", False)
    assert MAGRPOConfig(**settings, use_cpu=True).metric_for_best_model is None
