"""Plugins from really installed packages (`tests/plugins/*`, pip-installed into a folder put on the path): listing,
use by name in training, a broken plugin, a name clash, in-process registration, and the `trl-marl` CLI."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_marl import (
    MAGRPOConfig,
    MAGRPOTrainer,
    PluginError,
    Task,
    load_team,
    register_episode,
    register_reward,
    register_task,
)
from trl_marl.registry import discover, get_plugin, load_plugin, unregister
from trl_marl.tasks import local_rewards

PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory) -> Path:
    """The three test packages, installed by pip (their entry points written by setuptools) into one folder."""
    site = tmp_path_factory.mktemp("plugin-site")
    packages = [str(PLUGINS / name) for name in ("testplugins", "brokenplugin", "clashplugin")]
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
    ]
    result = subprocess.run([*command, *packages], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return site


@pytest.fixture
def installed(plugin_site, monkeypatch):
    """The test packages visible to this process (entry points are read from sys.path at each lookup)."""
    monkeypatch.syspath_prepend(str(plugin_site))
    return plugin_site


def run_cli(plugin_site, *arguments, timeout=900):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(plugin_site)}
    command = [sys.executable, "-m", "trl_marl.cli", *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def test_installed_plugins_are_discovered_with_their_distribution(installed):
    sources = {(p.name, p.source) for kind in ("rewards", "tasks", "schedulers") for p in discover(kind)}
    assert ("fewest_words", "trl-marl-testplugins") in sources
    assert ("greetings", "trl-marl-testplugins") in sources
    assert ("reverse_order", "trl-marl-testplugins") in sources
    # trl_marl's own plugins come through its own entry points, like anyone's
    assert {("parallel", "trl-marl"), ("explain", "trl-marl"), ("answer_match", "trl-marl")} <= sources


def test_listing_does_not_import_plugins(installed):
    assert "trl_marl_testplugins" not in sys.modules or pytest.skip("imported by an earlier test in this process")
    discover("rewards")
    assert "trl_marl_testplugins" not in sys.modules


def test_a_broken_plugin_is_reported_with_its_entry_point_distribution_and_error(installed):
    plugin = get_plugin("rewards", "broken_reward")
    assert plugin.description.startswith("BROKEN: ImportError: this plugin needs a library")
    with pytest.raises(PluginError) as error:
        load_plugin("rewards", "broken_reward")
    message = str(error.value)
    assert "'broken_reward = trl_marl_brokenplugin:reward'" in message
    assert "distribution 'trl-marl-brokenplugin'" in message
    assert "ImportError: this plugin needs a library that is not installed" in message
    # the others still load
    assert callable(load_plugin("rewards", "fewest_words"))


def test_two_plugins_with_one_name_are_an_error_naming_both_distributions(installed):
    with pytest.raises(PluginError, match="Two reward plugins are named 'shared_name'") as error:
        load_plugin("rewards", "shared_name")
    assert "trl-marl-testplugins" in str(error.value) and "trl-marl-clashplugin" in str(error.value)


def test_an_unknown_name_lists_what_is_installed():
    with pytest.raises(PluginError, match="No reward plugin named 'nope'.*'answer_match'"):
        load_plugin("rewards", "nope")


def test_in_process_registration_makes_a_reward_usable_by_name():
    @register_reward("notebook_reward")
    def notebook_reward(prompts, completions, **kwargs):
        """Always one."""
        return [1.0] * len(prompts)

    try:
        assert load_plugin("rewards", "notebook_reward") is notebook_reward
        assert get_plugin("rewards", "notebook_reward").description == "Always one."
    finally:
        unregister("rewards", "notebook_reward")


def test_a_bare_decorator_registers_the_object_under_its_own_name_and_returns_it():
    @register_episode
    def bare_program(client, row):
        return 1.0

    try:
        assert callable(bare_program) and bare_program(None, {}) == 1.0  # the function itself, not a decorator
        assert load_plugin("episodes", "bare_program") is bare_program
        assert (
            MAGRPOConfig(output_dir="out", agents=["writer", "critic"], episode="bare_program", use_cpu=True).episode
            == "bare_program"
        )
    finally:
        unregister("episodes", "bare_program")


def test_a_training_run_uses_the_packages_task_reward_and_scheduler_by_name(installed, tiny_model_dir, tmp_path):
    args = MAGRPOConfig.for_task(
        "greetings",
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        learning_rate=5e-2,
        lora_r=4,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    assert args.agent_names == ["host", "guest"] and args.num_turns == 2 and args.scheduler == "reverse_order"
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, task="greetings")
    assert trainer.reward_func_names == ["fewest_words"]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
    # reverse_order: the guest acts first, so the host is shown the guest's answer of the same turn
    assert trainer.scheduler.phases(0, 2) == [[1], [0]]


def test_an_episode_plugin_named_in_the_config_is_the_rollout(installed, tiny_model_dir, tmp_path):
    pytest.importorskip("fastapi", reason="episodes are served by the `serve` extra (FastAPI, uvicorn)")
    args = MAGRPOConfig(
        output_dir=str(tmp_path),
        agents=["host", "guest"],
        episode="each_agent_once",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=1,
        learning_rate=5e-2,
        lora_r=4,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    dataset = Dataset.from_dict({"prompt": ["Say hello.", "Say goodbye."]})
    trainer = MAGRPOTrainer(tiny_model_dir, "fewest_words", args=args, train_dataset=dataset)
    assert trainer.episode.__name__ == "each_agent_once"
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    moved = {
        n.split(".")[-2] for n, p in trainer.model.named_parameters() if n in before and not torch.equal(before[n], p)
    }
    assert moved == {"host", "guest"} and trainer.state.log_history[0]["episodes/calls_mean"] == 2.0
    with pytest.raises(ValueError, match="`episode`: No episode plugin named 'each_agent_twice'"):
        MAGRPOConfig(output_dir=str(tmp_path), agents=["host", "guest"], episode="each_agent_twice")


def test_cli_list_shows_plugins_sources_docs_and_marks_broken_and_clashing_ones(plugin_site):
    result = run_cli(plugin_site, "list")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()

    def line_of(name):
        return next(line for line in lines if line.strip().startswith(name + " "))

    assert "trl-marl-testplugins" in line_of("fewest_words") and "1 / (1 + the team's total" in line_of("fewest_words")
    assert "Two agents greet in two turns" in line_of("greetings")
    assert "last agent first" in line_of("reverse_order")
    assert "BROKEN: ImportError" in line_of("broken_reward")
    assert "NAME CLASH" in line_of("shared_name")
    assert "parallel" in result.stdout and "explain" in result.stdout

    only_schedulers = run_cli(plugin_site, "list", "schedulers")
    assert "schedulers (trl_marl.schedulers):" in only_schedulers.stdout and "rewards (" not in only_schedulers.stdout


@pytest.mark.slow
def test_cli_help_is_available_for_every_command(plugin_site):
    for arguments in (["--help"], ["list", "--help"], ["train", "--help"]):
        result = run_cli(plugin_site, *arguments)
        assert result.returncode == 0 and "usage: trl-marl" in result.stdout, arguments


@pytest.mark.slow
def test_cli_train_trains_from_a_yaml_recipe_on_the_default_model(installed, default_model_dir, tmp_path):
    plugin_site = installed
    config = tmp_path / "team.yaml"
    config.write_text(
        "task: greetings\n"
        f"output_dir: {tmp_path / 'out'}\n"
        "per_device_train_batch_size: 2\nnum_generations: 2\nmax_completion_length: 6\nmax_steps: 2\n"
        "learning_rate: 1.0e-3\nlora_r: 4\nreport_to: none\nsave_strategy: 'no'\nuse_cpu: true\nbf16: false\n"
    )
    result = run_cli(plugin_site, "train", str(config), "--max_steps", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Team saved in" in result.stdout
    assert (tmp_path / "out" / "host" / "adapter_model.safetensors").is_file()
    assert '"scheduler": "reverse_order"' in (tmp_path / "out" / "team.json").read_text()
    # the saved team plays with the scheduler it trained with: the guest first, then the host, who sees its answer
    team = load_team(tmp_path / "out")
    assert team.scheduler.name == "reverse_order"
    first_turn = team.run([{"role": "user", "content": "Say hello to E."}], max_new_tokens=4).observations[0]
    assert "[guest] " in first_turn["host"][-1]["content"]
    assert "[host]" not in first_turn["guest"][-1]["content"]


def test_cli_train_with_a_wrong_key_fails_before_loading_the_model_naming_it(plugin_site, tmp_path):
    config = tmp_path / "team.yaml"
    config.write_text(f"task: greetings\noutput_dir: {tmp_path}\nnum_generaitons: 2\n")
    result = run_cli(plugin_site, "train", str(config), timeout=300)
    assert result.returncode != 0
    assert "unknown key(s) 'num_generaitons' (did you mean 'num_generations'?)" in result.stderr
    assert "Loading weights" not in result.stderr


class Greeters(Task):
    """Two agents greet; the host also has local rewards of its own."""

    name = "greeters"
    agents = [{"name": "host"}, {"name": "guest"}]
    reward_funcs = [lambda prompts, completions, **kwargs: [1.0] * len(prompts)]

    @staticmethod
    def _chars(prompts, completions, **kwargs):
        return [float(len(text)) for text in completions]

    local_reward_funcs = {"host": [_chars, lambda prompts, completions, **kwargs: [0.5] * len(completions)]}

    def dataset(self, split="train"):
        return Dataset.from_dict({"prompt": ["Hi.", "Hello."]})


def test_task_local_rewards_sum_per_agent_and_are_logged(tiny_model_dir, tmp_path):
    task = Greeters()
    assert local_rewards(task, "host", ["p", "p"], ["ab", "abcd"]) == [2.5, 4.5]  # characters + 0.5
    assert local_rewards(task, "guest", ["p"], ["ab"]) is None
    args = MAGRPOConfig.for_task(
        task,
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=3,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        logging_steps=1,
    )
    scored = []

    def recorded_chars(prompts, completions, **kwargs):
        scored.extend(completions)
        return Greeters._chars(prompts, completions)

    task.local_reward_funcs = {"host": [recorded_chars, task.local_reward_funcs["host"][1]]}
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, task=task)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert len(scored) == 2  # the host's two completions (one prompt, G=2)
    assert logs["agents/host/local_reward"] == pytest.approx(sum(len(t) + 0.5 for t in scored) / 2, rel=1e-4)
    assert "agents/guest/local_reward" not in logs


def test_a_local_reward_with_the_wrong_count_names_it_and_the_agent():
    class Bad(Greeters):
        local_reward_funcs = {"host": [lambda prompts, completions, **kwargs: [1.0]]}

    with pytest.raises(ValueError, match="Local reward '<lambda>' of agent 'host' returned 1 values for 2"):
        local_rewards(Bad(), "host", ["p", "p"], ["a", "b"])


def test_reward_plugins_by_name_combine_with_trls_reward_weights(tiny_model_dir, tmp_path):
    args = MAGRPOConfig(
        output_dir=str(tmp_path),
        agents=["solver", "checker"],
        reward_weights=[1.0, 0.5],
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=3,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
    )
    dataset = Dataset.from_dict({"prompt": ["1+1?", "2+2?"], "answer": ["2", "4"], "word_limit": [2, 2]})
    trainer = MAGRPOTrainer(tiny_model_dir, ["answer_match", "word_budget"], args=args, train_dataset=dataset)
    assert trainer.reward_func_names == ["answer_match", "word_budget"]
    trainer.train()
    logs = trainer.state.log_history[0]
    expected = logs["rewards/answer_match/mean"] + 0.5 * logs["rewards/word_budget/mean"]
    assert logs["reward"] == pytest.approx(expected, abs=1e-6)


def test_load_team_of_an_unregistered_task_says_to_register_it_or_pass_the_transition(tiny_model_dir, tmp_path):
    args = MAGRPOConfig.for_task(Greeters(), output_dir=str(tmp_path), num_turns=2, report_to="none", use_cpu=True)
    MAGRPOTrainer(tiny_model_dir, args=args, task=Greeters()).save_model()
    with pytest.raises(ValueError, match="trained on task 'greeters'.*Install or register the task"):
        load_team(tmp_path)
    register_task("greeters")(Greeters)
    try:
        assert load_team(tmp_path).run("Hi.", max_new_tokens=2).turns
    finally:
        unregister("tasks", "greeters")
