"""The `trl-marl` command as a TRL user meets it: `--config` and `--help` as in `trl grpo`, TRL's dataset arguments
(a local data file, its test split for evaluation), a task's eval split, and one-line errors, before any model
loads, for every mistake that can be seen then."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
from datasets import Dataset

from trl_marl import MAGRPOConfig, MAGRPOTrainer, PluginError
from trl_marl.cli import main
from trl_marl.cli.train import UsageError, parse_train_config
from trl_marl.registry import get_plugin

QUESTIONS = ["What is 2 plus 2?", "What colour is snow?", "Name a fruit.", "What is 3 times 3?"]


def cli_env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRL_MARL_DEBUG": ""}


def run_cli(*arguments, timeout=600):
    command = [sys.executable, "-m", "trl_marl.cli", *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=cli_env(), timeout=timeout)


def write_prompts(path, questions, **columns):
    with open(path, "w") as file:
        for i, question in enumerate(questions):
            row = {"prompt": [{"role": "user", "content": question}], **{k: v[i] for k, v in columns.items()}}
            file.write(json.dumps(row) + "\n")
    return path


def dataset_config(tmp_path, model_dir, **extra) -> str:
    """A YAML run on a local JSON file with the `word_budget` reward plugin, no task."""
    train = write_prompts(tmp_path / "train.jsonl", QUESTIONS, word_limit=[3, 3, 3, 3])
    lines = {
        "model_name_or_path": model_dir,
        "dataset_name": str(train),
        "rewards": ["word_budget"],
        "agents": ["writer", "checker"],
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_completion_length": 4,
        "max_steps": 2,
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "use_cpu": True,
        **extra,
    }
    path = tmp_path / "team.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in lines.items()))
    return str(path)


def refuse_model_loads(monkeypatch):
    """Any model load fails the test: the error must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("trl_marl.team.bases.create_model_from_path", refuse)
    monkeypatch.setattr("trl_marl.team.saved_bases.load_saved_bases", refuse)  # a saved team's bases


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: the error must come before it."""
    refuse_model_loads(monkeypatch)


def one_line_error(capsys, arguments) -> str:
    assert main(arguments) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trl-marl: error: "), captured.err
    assert "Traceback" not in captured.err
    return lines[0].removeprefix("trl-marl: error: ")


# --- --config and --help, as in TRL ---


def test_config_flag_and_positional_config_parse_to_the_same_config(tmp_path, monkeypatch):
    path = dataset_config(tmp_path, "unused")
    given = []
    monkeypatch.setattr("trl_marl.cli.command.train", lambda config, arguments: given.append((config, arguments)) or 0)
    for form in (["--config", path], [f"--config={path}"], [path]):
        assert main(["train", *form, "--learning_rate", "0.01"]) == 0
    assert given == [(path, ["--learning_rate", "0.01"])] * 3
    script_args, args = parse_train_config(*given[0])
    assert args.learning_rate == 0.01 and script_args.dataset_name == str(tmp_path / "train.jsonl")


def test_train_help_lists_every_field_with_its_help_text(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: trl-marl train")
    fields = [f for f in dataclasses.fields(MAGRPOConfig) if f.init]
    missing = [f.name for f in fields if f"--{f.name}" not in text]
    assert missing == []
    for name in ("dataset_name", "dataset_test_split", "task", "rewards", "model_name_or_path"):
        assert f"--{name}" in text
    # help texts, not just names: one of TRL's, one of the team's, one of the script's
    assert "Upper bound on joint actions" in text and "Task plugin name" in text
    assert "Number of generations per prompt" in text or "num_generations" in text

    with pytest.raises(SystemExit):
        main(["train", "--algorithm", "at_grpo", "--help"])
    assert "--team_reward_weight" in capsys.readouterr().out  # the algorithm's own fields


# --- TRL's dataset arguments and evaluation ---


@pytest.mark.slow
def test_a_yaml_run_on_a_local_json_file_evaluates_on_its_test_file(tiny_model_dir, tmp_path):
    test = write_prompts(tmp_path / "test.jsonl", QUESTIONS[:2], word_limit=[3, 3])
    config = dataset_config(
        tmp_path, tiny_model_dir, eval_strategy="steps", eval_steps=1, dataset_test_split=str(test),
        per_device_eval_batch_size=2,
    )  # fmt: skip
    result = run_cli("train", "--config", config)
    assert result.returncode == 0, result.stderr[-3000:]
    evaluations = [line for line in result.stdout.splitlines() if "'eval_reward'" in line]
    assert len(evaluations) == 2, result.stdout[-3000:]  # eval_steps: 1, max_steps: 2
    assert (tmp_path / "out" / "writer" / "adapter_model.safetensors").is_file()
    assert result.stdout.count("Team saved in") == 1


def test_a_task_supplies_its_eval_split_when_evaluation_is_on(tiny_model_dir, tmp_path):
    from trl_marl.tasks import resolve_task

    task = resolve_task("explain")
    args = MAGRPOConfig.for_task(
        task, output_dir=str(tmp_path), eval_strategy="steps", eval_steps=1, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, num_generations=2, max_completion_length=4, report_to="none", use_cpu=True,
    )  # fmt: skip
    trainer = MAGRPOTrainer(tiny_model_dir, args=args, task=task)
    assert trainer.eval_dataset["prompt"] == task.dataset("eval")["prompt"]
    assert trainer.eval_dataset["prompt"] != trainer.train_dataset["prompt"][: len(trainer.eval_dataset)]
    metrics = trainer.evaluate()
    assert "eval_reward" in metrics and 0.0 <= metrics["eval_reward"] <= 1.0

    args = MAGRPOConfig.for_task(
        task,
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        report_to="none",
        use_cpu=True,
    )
    without = MAGRPOTrainer(tiny_model_dir, args=args, task=task)
    assert without.eval_dataset is None  # no evaluation asked: nothing loaded for it


# --- one-line errors, before any model loads ---


def test_an_unknown_flag_names_the_closest_field(tmp_path, capsys, no_model_load):
    path = dataset_config(tmp_path, "unused")
    message = one_line_error(capsys, ["train", path, "--max_stpes", "2"])
    assert (
        message
        == "unknown flag '--max_stpes' (did you mean '--max_steps'?). `trl-marl train --help` lists every field."
    )
    # HF's parser has --no_<field> only for fields that default to true: gradient_checkpointing has one, use_vllm not
    message = one_line_error(capsys, ["train", path, "--no-use-vllm"])
    assert message == "unknown flag '--no_use_vllm': `use_vllm` is not on by default; pass '--use_vllm false'."
    script_args, args = parse_train_config(path, ["--no_gradient_checkpointing", "--use_vllm", "false"])
    assert args.gradient_checkpointing is False and args.use_vllm is False


def test_an_unknown_key_names_the_closest_field(tmp_path, capsys, no_model_load):
    path = tmp_path / "team.yaml"
    path.write_text("task: explain\nnum_generaitons: 2\n")
    message = one_line_error(capsys, ["train", str(path)])
    assert message.startswith(f"{path}: unknown key(s) 'num_generaitons' (did you mean 'num_generations'?).")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("task: explian\n", "`task`: No task plugin named 'explian' (did you mean 'explain'?)."),
        ("task: explain\nrewards: [answer_mach]\n", "`rewards`: No reward plugin named 'answer_mach' (did you mean "
         "'answer_match'?)."),
        ("task: explain\nscheduler: sequentail\n", "`scheduler`: No scheduler plugin named 'sequentail' (did you mean "
         "'sequential'?)."),
    ],
)  # fmt: skip
def test_an_unknown_plugin_names_the_closest_installed_one(tmp_path, capsys, no_model_load, line, expected):
    path = tmp_path / "team.yaml"
    path.write_text(line + "use_cpu: true\n")
    message = one_line_error(capsys, ["train", str(path)])
    assert message.startswith(f"{path}: {expected} Installed: [")


def test_a_config_without_data_says_how_to_give_it(tmp_path, capsys, no_model_load):
    path = tmp_path / "team.yaml"
    path.write_text("agents: [writer, checker]\nuse_cpu: true\n")
    message = one_line_error(capsys, ["train", str(path)])
    assert message.startswith(f"{path}: no training data: set `task` (a task plugin, `trl-marl list tasks`) or "
                              "`dataset_name`")  # fmt: skip


def test_data_without_a_prompt_column_names_the_column_before_the_model_loads(tmp_path, capsys, no_model_load):
    path = dataset_config(tmp_path, "unused")
    with open(tmp_path / "questions.jsonl", "w") as file:
        file.write(json.dumps({"question": "Hi?", "word_limit": 3}) + "\n")
    message = one_line_error(capsys, ["train", path, "--dataset_name", str(tmp_path / "questions.jsonl")])
    assert message.startswith("The train dataset has no `prompt` column (its columns: ['question', 'word_limit'])")


def test_evaluation_without_a_test_split_names_the_splits(tmp_path, capsys, no_model_load):
    path = dataset_config(tmp_path, "unused", eval_strategy="steps", eval_steps=1)
    message = one_line_error(capsys, ["train", path])
    assert message.startswith("`eval_strategy: steps` needs the test split, but the dataset")
    assert "has no split 'test' (its splits: ['train'])" in message


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    message = one_line_error(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert message == f"Cannot read the config file {tmp_path / 'nope.yaml'}: No such file or directory."


def test_a_field_check_of_the_config_is_one_line_naming_the_field(tmp_path, capsys, no_model_load):
    path = dataset_config(tmp_path, "unused")
    message = one_line_error(capsys, ["train", path, "--num_generations", "1"])
    assert message.startswith(f"{path}: `num_generations` must be at least 2 (got 1)")


def test_other_commands_name_the_closest_flag_or_plugin(capsys):
    assert one_line_error(capsys, ["list", "--kinds"]).startswith("trl-marl list: unknown argument '--kinds'")
    message = one_line_error(capsys, ["evaluate", "explian"])
    assert message.startswith("No task plugin named 'explian' (did you mean 'explain'?).")
    assert one_line_error(capsys, ["evaluate", "explain", "--limt", "2"]) == (
        "trl-marl evaluate: unknown argument '--limt' (did you mean '--limit'?)."
    )


def test_a_value_of_the_wrong_type_is_one_line_naming_the_flag(tmp_path, capsys, no_model_load):
    path = dataset_config(tmp_path, "unused")
    assert one_line_error(capsys, ["train", path, "--max_steps", "abc"]) == (
        "argument --max_steps/--max-steps: invalid int value: 'abc'"
    )
    message = one_line_error(capsys, ["train", path, "--adapter_mode", "bogus"])
    assert message.startswith("argument --adapter_mode/--adapter-mode: invalid choice: 'bogus'")


def test_a_field_of_the_other_algorithm_says_which_algorithm_has_it(tmp_path, capsys, no_model_load):
    path = dataset_config(tmp_path, "unused")
    message = one_line_error(capsys, ["train", path, "--team_reward_weight", "0.5"])
    assert message.startswith("unknown flag '--team_reward_weight' (a field of at_grpo: set `algorithm: at_grpo`).")


def test_one_reward_given_as_a_string_is_a_list_of_one(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text("task: describe_word\nrewards: word_budget\nuse_cpu: true\n")
    script_args, _ = parse_train_config(str(path))
    assert script_args.rewards == ["word_budget"]


def test_a_task_without_data_sources_given_one_is_one_line(tmp_path, capsys, no_model_load):
    path = tmp_path / "team.yaml"
    path.write_text("task: explain\nuse_cpu: true\n")
    message = one_line_error(capsys, ["train", str(path), "--task_source", "hub"])
    assert message.startswith(f"{path}: `task_source`: Task 'Explain' does not take the options ['source']")


def test_a_dataset_without_rewards_or_on_a_missing_file_is_named(tmp_path, capsys, no_model_load):
    path = tmp_path / "team.yaml"
    path.write_text(f"dataset_name: {tmp_path / 'questions.jsonl'}\nagents: [writer, checker]\nuse_cpu: true\n")
    assert one_line_error(capsys, ["train", str(path)]).startswith(
        f"{path}: `dataset_name` without a `task` needs `rewards`"
    )
    message = one_line_error(capsys, ["train", str(path), "--rewards", "word_budget"])
    assert message == f"No such data file or folder: {tmp_path / 'questions.jsonl'}."


def test_a_model_folder_that_does_not_exist_is_named(tmp_path, capsys):
    path = dataset_config(tmp_path, str(tmp_path / "no-model"))
    message = one_line_error(capsys, ["train", path])
    assert message == f"{path}: `model_name_or_path`: no such folder: {tmp_path / 'no-model'}."


def test_the_config_goes_first_and_debug_before_it_is_ours(tmp_path, capsys, no_model_load):
    path = dataset_config(tmp_path, "unused")
    message = one_line_error(capsys, ["train", "--max_steps", "2", path])
    assert message == "trl-marl train: the config file goes first: trl-marl train CONFIG [--field value ...]."
    bad = tmp_path / "bad.yaml"
    bad.write_text("task: explian\n")
    with pytest.raises(UsageError, match="No task plugin named 'explian'"):  # `--debug` then the config: ours
        main(["train", "--debug", str(bad)])
    assert one_line_error(capsys, []) == "the following arguments are required: command"


def test_evaluate_names_a_missing_team_or_a_baseline_that_does_not_go_with_it(tmp_path, capsys):
    message = one_line_error(capsys, ["evaluate", "explain", "--team", str(tmp_path / "nope")])
    assert message.startswith(f"No team at '{tmp_path / 'nope'}'")
    (tmp_path / "empty").mkdir()
    message = one_line_error(capsys, ["evaluate", "explain", "--team", str(tmp_path / "empty")])
    assert message.startswith(f"No team.json in {tmp_path / 'empty'}")
    message = one_line_error(capsys, ["evaluate", "explain", "--team", str(tmp_path), "--baseline", "sequential"])
    assert message == "trl-marl evaluate: --team PATH goes with --baseline team (its default), and only with it."
    message = one_line_error(capsys, ["evaluate", "explain", "--dtype", "bfloat16"])
    assert message == "trl-marl evaluate: --load_in_4bit and --dtype set how a team's bases load (with --team)."
    message = one_line_error(capsys, ["evaluate", "explain", "--split", "test"])  # a task has train and eval only
    assert message.startswith("trl-marl evaluate: argument --split: invalid choice: 'test' (choose from ")
    assert message.replace("'", "").endswith("(choose from train, eval)")  # newer argparse quotes them


def test_evaluating_a_team_whose_tool_cannot_be_rebuilt_says_to_use_evaluate_task_before_any_model_loads(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    def look_up(word: str) -> str:
        """Look a word up.

        Args:
            word: The word.
        """
        return word

    args = MAGRPOConfig(
        output_dir=str(tmp_path), agents=["solo"], per_device_train_batch_size=2, num_generations=2,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": ["Hi."]})
    MAGRPOTrainer(tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args=args,
                  train_dataset=dataset, tools=[look_up]).save_model(str(tmp_path / "team"))  # fmt: skip
    refuse_model_loads(monkeypatch)  # the team is saved: from here on, any model load fails the test
    capsys.readouterr()  # what saving printed
    message = one_line_error(capsys, ["evaluate", "explain", "--team", str(tmp_path / "team")])
    assert message.startswith(
        f"trl-marl evaluate: The team in {tmp_path / 'team'} trained every agent (the trainer's `tools=`) with the "
        "tool 'look_up', which has no importable name"
    )
    assert message.endswith(
        "pass it again from Python (the command cannot pass a function or class): "
        "trl_marl.cli.evaluation.evaluate_task(..., tools=[look_up])."
    )


@pytest.mark.slow
def test_the_real_command_exits_2_with_one_line_and_debug_shows_the_traceback(tmp_path):
    path = tmp_path / "team.yaml"
    path.write_text("task: explian\n")
    result = run_cli("train", str(path), timeout=300)
    assert result.returncode == 2
    errors = result.stderr.splitlines()
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"trl-marl: error: {path}: `task`: No task plugin named 'explian'")
    debugged = run_cli("--debug", "train", str(path), timeout=300)
    assert debugged.returncode == 1 and "Traceback (most recent call last)" in debugged.stderr
    assert "UsageError" in debugged.stderr


@pytest.mark.slow
def test_a_command_that_uses_no_4bit_layer_prints_nothing_about_bitsandbytes_kernels():
    # On CPUs with AVX512-BF16 importing bitsandbytes (PEFT does) logs that its optional `kernels` package is missing:
    # it names a kernel of a 4-bit inference path that trl_marl never takes (`keep_4bit_weights_trainable`).
    listed = run_cli("list", "tasks", timeout=300)
    assert listed.returncode == 0 and "explain" in listed.stdout
    imported = subprocess.run(
        [sys.executable, "-c", "import trl_marl; from transformers import BitsAndBytesConfig; import bitsandbytes"],
        capture_output=True, text=True, env=cli_env(), timeout=300,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr[-2000:]
    for output in (listed.stdout + listed.stderr, imported.stdout + imported.stderr):
        assert not [line for line in output.splitlines() if "kernels" in line or "gemm_4bit" in line], output


# --- plugin names, checked when a config is built ---


def test_a_config_with_an_unknown_scheduler_fails_when_built_naming_the_field():
    with pytest.raises(ValueError, match=r"`scheduler`: No scheduler plugin named 'nope'\. Installed: \["):
        MAGRPOConfig(output_dir="unused", agents=["writer", "checker"], scheduler="nope", use_cpu=True)
    with pytest.raises(PluginError, match=r"did you mean 'round_robin'\?"):
        get_plugin("schedulers", "round_robn")


def test_evaluation_without_data_fails_before_the_model_loads():
    def reward(prompts, completions, **kwargs):
        return [1.0] * len(prompts)

    args = MAGRPOConfig(output_dir="unused", agents=["writer", "checker"], use_cpu=True, num_generations=2,
                        per_device_train_batch_size=2, eval_strategy="steps", eval_steps=1)  # fmt: skip
    data = Dataset.from_dict({"prompt": ["Hi?"]})
    with pytest.raises(ValueError, match=r"`eval_strategy='steps'` needs evaluation data: pass `eval_dataset`, or a"):
        MAGRPOTrainer("no/such-model", reward, args=args, train_dataset=data)


def test_the_python_api_names_a_missing_prompt_column_before_the_model_loads():
    def reward(prompts, completions, **kwargs):
        return [1.0] * len(prompts)

    args = MAGRPOConfig(output_dir="unused", agents=["writer", "checker"], use_cpu=True, num_generations=2,
                        per_device_train_batch_size=2)  # fmt: skip
    data = Dataset.from_dict({"question": ["Hi?"]})
    with pytest.raises(ValueError, match=r"The train dataset has no `prompt` column \(its columns: \['question'\]\)"):
        MAGRPOTrainer("no/such-model", reward, args=args, train_dataset=data)


# --- several processes ---


@pytest.mark.slow
def test_torchrun_prints_team_saved_once(tiny_model_dir, tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    config = dataset_config(tmp_path, tiny_model_dir, max_steps=1)
    command = [torchrun, "--nproc_per_node", "2", "-m", "trl_marl.cli", "train", config]
    result = subprocess.run(command, capture_output=True, text=True, env=cli_env(), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Team saved in") == 1, result.stdout[-3000:]
