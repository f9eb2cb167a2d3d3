"""`trl-marl train`: a team from a YAML config and `--field value` flags, the way `trl grpo --config` trains one
policy. The config holds `algorithm` (magrpo, at_grpo, iac or maac), that algorithm's config fields (`MAGRPOConfig`,
`ATGRPOConfig`, `IACConfig`, `MAACConfig`), and the script arguments below: a task plugin, or TRL's dataset arguments
with reward plugins.

Every mistake that can be seen in the config or the flags (a key or flag that is no field, an unknown plugin, no
data, a dataset without the asked split) is a `UsageError` raised before any model loads; `trl-marl` prints it as
one line.
"""

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import yaml
from trl import ScriptArguments

from ..registry import PluginError, check_plugin_name, did_you_mean

ALGORITHMS = ("magrpo", "at_grpo", "iac", "maac")
# The algorithms `trl-marl evaluate` scores a team with (an actor-critic team is scored as MAGRPO plays it).
EVALUATED_ALGORITHMS = ("magrpo", "at_grpo")
# Data files `dataset_name` / `dataset_test_split` may name, by suffix: the `datasets` builder that reads them.
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
DATA_FILES = "/".join(DATA_FILE_BUILDERS)


class UsageError(ValueError):
    """A mistake in the command line, the config file or its data, found before training starts."""


@dataclass
class TrainArguments(ScriptArguments):
    """What `trl-marl train` needs besides the algorithm's config: TRL's script arguments (`dataset_name`,
    `dataset_config`, `dataset_train_split`, `dataset_test_split`) and the team's."""

    algorithm: str = field(
        default="magrpo",
        metadata={
            "help": "magrpo (MAGRPOTrainer), at_grpo (ATGRPOTrainer), iac (IACTrainer) or maac (MAACTrainer).",
            "choices": list(ALGORITHMS),
        },
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model (Hub id or path); defaults to the embedded SmolLM2-135M-Instruct."}
    )
    task: str | None = field(
        default=None,
        metadata={"help": "Task plugin name (`trl-marl list tasks`): its agents, rewards and data. Without it, give "
                  "`dataset_name` and `rewards`."},
    )  # fmt: skip
    task_source: str | None = field(
        default=None,
        metadata={"help": "The task's data source, for tasks that offer several: 'offline' (their default) or 'hub' "
                  "(the paper's Hub datasets; needs the network or a Hub cache)."},
    )  # fmt: skip
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "Load the base model in 4-bit NF4 with bitsandbytes (QLoRA): the team's adapters train on "
                  "one quantized base."},
    )  # fmt: skip
    rewards: list[str] | None = field(
        default=None,
        metadata={"help": "Team reward plugin names (`trl-marl list rewards`); default: the task's rewards."},
    )


def algorithm_classes(algorithm: str) -> tuple[type, type]:
    """`(config class, trainer class)` of `algorithm` (one of `ALGORITHMS`)."""
    from ..config import ATGRPOConfig, IACConfig, MAACConfig, MAGRPOConfig
    from ..trainers.actor_critic_trainer import IACTrainer, MAACTrainer
    from ..trainers.atgrpo_trainer import ATGRPOTrainer
    from ..trainers.magrpo_trainer import MAGRPOTrainer

    return {
        "magrpo": (MAGRPOConfig, MAGRPOTrainer),
        "at_grpo": (ATGRPOConfig, ATGRPOTrainer),
        "iac": (IACConfig, IACTrainer),
        "maac": (MAACConfig, MAACTrainer),
    }[algorithm]


def train_parser(algorithm: str):
    """TRL's parser over `TrainArguments` and the algorithm's config; its `--help` lists every field, and its
    mistakes (a value of the wrong type, a choice that is none) are one-line `UsageError`s."""
    from trl import TrlParser

    class Parser(TrlParser):
        def error(self, message: str):
            raise UsageError(message)

    config_class, _ = algorithm_classes(algorithm)
    parser = Parser((TrainArguments, config_class), prog="trl-marl train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML file of fields (as `trl grpo --config`); flags override it.")
    for name, (neutral, _) in config_class.not_applicable.items():  # the sibling's fields: checked after parsing
        parser.add_argument(f"--{name}", type=type(neutral), default=neutral, help=argparse.SUPPRESS)
    return parser


def parse_train_config(
    config_path: str | None, overrides: list[str] | tuple[str, ...] = (), require_data: bool = True
) -> tuple[TrainArguments, Any]:
    """`(TrainArguments, the algorithm's config)` from a `trl-marl train` YAML file (or none: flags only) and
    `--key value` overrides, validated as `trl-marl train` does, without loading a model. A key or flag that is no
    field, an unknown plugin, or no data (with `require_data`) is a `UsageError` naming it."""
    from ..tasks import task_defaults

    source = config_path or "the command line"
    values = read_config(config_path) if config_path else {}
    algorithm = flag_value(overrides, "--algorithm") or values.get("algorithm", "magrpo")
    if algorithm not in ALGORITHMS:
        raise UsageError(f"{source}: `algorithm` must be one of {list(ALGORITHMS)}, got {algorithm!r}.")
    config_class, _ = algorithm_classes(algorithm)
    known = field_names(config_class)
    check_keys(source, values, known, algorithm)
    check_flags(overrides, known | {"config", "help"}, algorithm)
    task_name = flag_value(overrides, "--task") or values.get("task")
    dataset_name = flag_value(overrides, "--dataset_name") or values.get("dataset_name")
    if require_data and not {"-h", "--help"} & set(overrides):
        strays = [a for i, a in enumerate(overrides) if i == 0 or not overrides[i - 1].startswith("-")]
        if config_path is None and any(a.endswith((".yaml", ".yml")) for a in strays):  # not a flag's value
            raise UsageError("trl-marl train: the config file goes first: trl-marl train CONFIG [--field value ...].")
        check_data_given(source, task_name, dataset_name, flag_value(overrides, "--rewards") or values.get("rewards"))
    parser = train_parser(algorithm)
    if task_name:  # the task's agents, turns and scheduler are defaults the file and flags may override
        task_source = flag_value(overrides, "--task_source") or values.get("task_source")
        parser.set_defaults(**task_defaults(task_plugin(source, task_name, task_source)))
    arguments = ["--config", config_path, *overrides] if config_path else list(overrides)
    try:
        parsed = parser.parse_args_and_config(arguments)
    except UsageError:  # the parser's own: it names the flag
        raise
    except ValueError as error:  # a field's own check (`__post_init__`): it names the field
        raise UsageError(f"{source}: {error}") from error
    script_args, args = parsed[:2]
    try:
        config_class.without_inapplicable(vars(parsed[2]) if len(parsed) > 2 else {})
    except ValueError as error:
        raise UsageError(f"{source}: {error}") from None
    if isinstance(script_args.rewards, str):  # `rewards: one_reward` in the file
        script_args.rewards = [script_args.rewards]
    for name in script_args.rewards or []:
        try:
            check_plugin_name("rewards", name, "rewards")
        except ValueError as error:
            raise UsageError(f"{source}: {error}") from None
    if script_args.dataset_streaming:
        raise UsageError(f"{source}: `dataset_streaming` is not supported by trl-marl train: leave it false.")
    return script_args, args


def check_data_given(source: str, task: str | None, dataset_name: str | None, rewards: Any) -> None:
    """Fail when there is nothing to train on: no task, or a dataset without the rewards that score it."""
    if not task and not dataset_name:
        raise UsageError(
            f"{source}: no training data: set `task` (a task plugin, `trl-marl list tasks`) or `dataset_name` (a Hub "
            f"dataset, a local data folder or a {DATA_FILES} file with a `prompt` column) and `rewards`."
        )
    if not task and not rewards:
        raise UsageError(
            f"{source}: `dataset_name` without a `task` needs `rewards`: the team reward plugins that score the team "
            "(`trl-marl list rewards`), e.g. `rewards: [answer_match]`."
        )


def task_plugin(source: str, name: str, task_source: str | None = None):
    """The task plugin `name` (with its data source), or a `UsageError` naming what is wrong."""
    from ..tasks import resolve_task

    try:
        return resolve_task(name, **({"source": task_source} if task_source else {}))
    except PluginError as error:
        raise UsageError(f"{source}: `task`: {error}") from None
    except TypeError as error:  # a task without data sources given `task_source`
        raise UsageError(f"{source}: `task_source`: {error}") from None


def read_config(config_path: str) -> dict:
    try:
        with open(config_path) as file:
            values = yaml.safe_load(file) or {}
    except OSError as error:
        raise UsageError(f"Cannot read the config file {config_path}: {error.strerror or error}.") from None
    except yaml.YAMLError as error:
        raise UsageError(f"{config_path} is not valid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(values, dict):
        raise UsageError(
            f"{config_path} must hold a YAML mapping of config fields, `algorithm`, `task` and `rewards`."
        )
    return values


def field_names(config_class: type) -> set[str]:
    """Every key `trl-marl train` takes with `config_class`: its fields, the script arguments, the sibling
    algorithm's fields (`parse_train_config` says whether they apply), and `env` (TRL's environment variables)."""
    known = {f.name for cls in (TrainArguments, config_class) for f in dataclasses.fields(cls)}
    return known | {"env", *config_class.not_applicable}


def true_by_default(algorithm: str) -> set[str]:
    """The boolean fields that default to true: the ones with a `--no_<field>` flag."""
    classes = (TrainArguments, algorithm_classes(algorithm)[0])
    return {f.name for cls in classes for f in dataclasses.fields(cls) if f.default is True}


def hint(name: str, known: set[str], algorithm: str, prefix: str = "") -> str:
    """What a name that is no field may have meant: a field of another algorithm, or the closest field."""
    for other in ALGORITHMS:
        if other != algorithm and name in {f.name for f in dataclasses.fields(algorithm_classes(other)[0])}:
            return f" (a field of {other}: set `algorithm: {other}`)"
    return did_you_mean(prefix + name, [prefix + key for key in known])


def check_keys(source: str, values: dict, known: set[str], algorithm: str) -> None:
    """Fail on a key that is no field, before anything is built (TRL's parser would first build the config, whose
    own checks could hide the misspelt key)."""
    unknown = sorted(set(values) - known)
    if unknown:
        config_class = algorithm_classes(algorithm)[0]
        hints = ", ".join(f"'{key}'{hint(key, known, algorithm)}" for key in unknown)
        raise UsageError(
            f"{source}: unknown key(s) {hints}. Keys are {config_class.__name__} / GRPOConfig fields, `env`, and the "
            "script arguments (`trl-marl train --help` lists them all)."
        )


def check_flags(arguments: list[str], known: set[str], algorithm: str) -> None:
    """Fail on a `--flag` that is no field (argparse would also take a prefix of one, or fail after the config
    file was read)."""
    for argument in arguments:
        if not argument.startswith("--"):
            continue
        name = argument[2:].split("=", 1)[0].replace("-", "_")
        if name in known or (name.startswith("no_") and name[3:] in true_by_default(algorithm)):
            continue
        if name.startswith("no_") and name[3:] in known:  # HF's parser adds --no_X only where X defaults to true
            raise UsageError(f"unknown flag '--{name}': `{name[3:]}` is not on by default; pass '--{name[3:]} false'.")
        closest = hint(name, known, algorithm, prefix="--")
        raise UsageError(f"unknown flag '--{name}'{closest}. `trl-marl train --help` lists every field.")


def flag_value(arguments: list[str], flag: str) -> str | None:
    """The value given to `flag` as `--flag value` or `--flag=value`, else None."""
    for i, argument in enumerate(arguments):
        if argument.startswith(flag + "="):
            return argument.split("=", 1)[1]
        if argument == flag and i + 1 < len(arguments):
            return arguments[i + 1]
    return None


def load_data_source(name: str, config: str | None = None):
    """A `DatasetDict` of `name`: a data file (its rows as the `train` split), a local data folder or a Hub dataset."""
    import datasets
    from datasets import DatasetDict, load_dataset

    suffix = os.path.splitext(name)[1].lower()
    if os.path.isfile(name) and suffix not in DATA_FILE_BUILDERS:
        raise UsageError(f"{name}: a data file must be one of {DATA_FILES}, got {suffix!r}.")
    if not os.path.exists(name) and (suffix in DATA_FILE_BUILDERS or name.startswith(("/", "./", "../", "~"))):
        raise UsageError(f"No such data file or folder: {name}.")
    bars_were_on = datasets.is_progress_bar_enabled()  # a small file's progress bars would only crowd an error
    datasets.disable_progress_bars()
    try:
        if os.path.isfile(name):
            return DatasetDict({"train": load_dataset(DATA_FILE_BUILDERS[suffix], data_files=name, split="train")})
        return load_dataset(name, name=config)
    except Exception as error:  # datasets raises many kinds (not found, offline, bad config): all mean "cannot load"
        raise UsageError(f"Cannot load the dataset {name!r}: {type(error).__name__}: {error}") from None
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def training_data(script_args: TrainArguments, args) -> tuple[Any, Any]:
    """`(train_dataset, eval_dataset)` of TRL's dataset arguments; `(None, None)` without `dataset_name` (a task
    supplies its own splits). The test split is loaded when evaluation is on (`eval_strategy`); it is a split of the
    dataset or a data file of its own."""
    if not script_args.dataset_name:
        return None, None
    name = script_args.dataset_name
    splits = load_data_source(name, script_args.dataset_config)
    if script_args.dataset_train_split not in splits:
        raise UsageError(
            f"The dataset {name!r} has no split {script_args.dataset_train_split!r} (its splits: {list(splits)}): set "
            "`dataset_train_split` to one of them."
        )
    eval_dataset = None
    if args.eval_strategy != "no":
        test = script_args.dataset_test_split
        if os.path.isfile(test) or os.path.splitext(test)[1].lower() in DATA_FILE_BUILDERS:
            eval_dataset = load_data_source(test)["train"]
        elif test in splits:
            eval_dataset = splits[test]
        else:
            raise UsageError(
                f"`eval_strategy: {args.eval_strategy.value}` needs the test split, but the dataset {name!r} has no "
                f"split {test!r} (its splits: {list(splits)}): set `dataset_test_split` to one of them or to a data "
                "file, or `eval_strategy: 'no'`."
            )
    return splits[script_args.dataset_train_split], eval_dataset


def train(config_path: str | None, overrides: list[str]) -> int:
    """`trl-marl train`: parse, check and load everything a mistake could be found in, then train and save."""
    from ..precision import four_bit_config
    from ..team.default_model import default_model_path

    script_args, args = parse_train_config(config_path, overrides)
    _, trainer_class = algorithm_classes(script_args.algorithm)
    source = config_path or "the command line"
    task = task_plugin(source, script_args.task, script_args.task_source) if script_args.task else None
    train_dataset, eval_dataset = training_data(script_args, args)
    model = script_args.model_name_or_path
    if model and not os.path.isdir(model) and model.startswith(("/", "./", "../", "~")):
        raise UsageError(f"{source}: `model_name_or_path`: no such folder: {model}.")
    try:
        trainer = trainer_class(
            model or default_model_path(),
            script_args.rewards,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            task=task,
            quantization_config=four_bit_config() if script_args.load_in_4bit else None,
        )
    except (ValueError, PluginError, OSError) as error:  # the inputs, checked before and as the model loads
        raise UsageError(" ".join(str(error).split())) from error
    trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        print(f"Team saved in {args.output_dir} (load it with trl_marl.load_team)")
    return 0
