"""The `trl-marl` command.

    trl-marl list [rewards|tasks|schedulers]      the installed plugins: name, source distribution, one-line doc
    trl-marl train CONFIG.yaml [--key value ...]  train a team; CONFIG.yaml holds `algorithm` (magrpo or at_grpo),
                                                  the config fields of that algorithm (MAGRPOConfig / ATGRPOConfig),
                                                  `task` (and `task_source`), `rewards`, `model_name_or_path` and
                                                  `load_in_4bit`; flags override the file
    trl-marl evaluate TASK [--baseline B] [--team PATH] [--model M] [--limit N] [--split S] [--task_source SRC]
                      [--algorithm magrpo|at_grpo] [--use_vllm [--vllm_gpu_memory_utilization U]]
                                                  a saved team or a baseline (single, parallel, sequential) on a task;
                                                  prints the task's metrics as JSON
    trl-marl estimate CONFIG.yaml [--prompt_length N] [--gpu_memory_gb 16 24]
                                                  predicted peak GPU memory of a `train` config (no weights load),
                                                  with use_vllm the vLLM engine's pool and KV cache on each card

`train` parses with TRL's `TrlParser`, as `trl grpo --config ...` does: a key that is no field fails before any
model loads, naming the key.
"""

import argparse
import dataclasses
import difflib
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

from .registry import GROUPS, discover


@dataclass
class TrainArguments:
    """What `trl-marl train` needs besides the algorithm's config."""

    algorithm: str = field(
        default="magrpo",
        metadata={"help": "magrpo (MAGRPOTrainer) or at_grpo (ATGRPOTrainer).", "choices": ["magrpo", "at_grpo"]},
    )

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Base model (Hub id or path); defaults to the embedded SmolLM2-135M-Instruct."}
    )
    task: str | None = field(default=None, metadata={"help": "Task plugin name (`trl-marl list tasks`)."})
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


def list_plugins(kinds: list[str]) -> int:
    """Print the plugins of `kinds`; broken ones are marked, never hidden. Returns the exit status (0)."""
    for kind in kinds:
        plugins = discover(kind)
        print(f"{kind} ({GROUPS[kind]}):")
        if not plugins:
            print("  (none)")
        names = [plugin.name for plugin in plugins]
        width = max((len(name) for name in names), default=0)
        for plugin in plugins:
            clash = "  [NAME CLASH: another plugin has this name]" if names.count(plugin.name) > 1 else ""
            print(f"  {plugin.name:<{width}}  {plugin.source:<24}  {plugin.description}{clash}")
    return 0


def parse_train_config(config_path: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[TrainArguments, Any]:
    """`(TrainArguments, MAGRPOConfig or ATGRPOConfig)` from a `trl-marl train` YAML file and `--key value` overrides,
    validated as `trl-marl train` does, without loading a model. A key that is no field fails, naming the key."""
    from trl import TrlParser

    from .tasks import resolve_task, task_defaults

    with open(config_path) as file:
        values = yaml.safe_load(file) or {}
    if not isinstance(values, dict):
        raise SystemExit(
            f"{config_path} must hold a YAML mapping of config fields, `algorithm`, `task` and `rewards`."
        )
    algorithm = _flag_value(overrides, "--algorithm") or values.get("algorithm", "magrpo")
    if algorithm not in ALGORITHMS:
        raise SystemExit(f"{config_path}: `algorithm` must be one of {sorted(ALGORITHMS)}, got {algorithm!r}.")
    config_class, _ = _algorithm_classes(algorithm)
    _check_keys(config_path, values, (TrainArguments, config_class))
    task_name = _flag_value(overrides, "--task") or values.get("task")
    parser = TrlParser((TrainArguments, config_class))
    for name, (neutral, _) in config_class.not_applicable.items():  # the sibling's fields: checked below
        parser.add_argument(f"--{name}", type=type(neutral), default=neutral, help=argparse.SUPPRESS)
    if task_name:  # the task's agents, turns and scheduler are defaults the file and flags may override
        parser.set_defaults(**task_defaults(resolve_task(task_name)))
    parsed = parser.parse_args_and_config(["--config", config_path, *overrides])
    if not config_class.not_applicable:
        return parsed
    script_args, args, inapplicable = parsed
    try:
        config_class.without_inapplicable(vars(inapplicable))
    except ValueError as error:
        raise SystemExit(f"{config_path}: {error}") from None
    return script_args, args


def train(config_path: str, overrides: list[str]) -> int:
    from .models import default_model_path, four_bit_config

    script_args, args = parse_train_config(config_path, overrides)
    _, trainer_class = _algorithm_classes(script_args.algorithm)
    task = None
    if script_args.task:
        from .tasks import resolve_task

        options = {"source": script_args.task_source} if script_args.task_source else {}
        task = resolve_task(script_args.task, **options)
    trainer = trainer_class(
        script_args.model_name_or_path or default_model_path(),
        script_args.rewards,
        args=args,
        task=task,
        quantization_config=four_bit_config() if script_args.load_in_4bit else None,
    )
    trainer.train()
    trainer.save_model(args.output_dir)
    print(f"Team saved in {args.output_dir} (load it with trl_marl.load_team)")
    return 0


ALGORITHMS = ("magrpo", "at_grpo")


def _algorithm_classes(algorithm: str) -> tuple[type, type]:
    from .atgrpo_trainer import ATGRPOTrainer
    from .config import ATGRPOConfig, MAGRPOConfig
    from .magrpo_trainer import MAGRPOTrainer

    return (ATGRPOConfig, ATGRPOTrainer) if algorithm == "at_grpo" else (MAGRPOConfig, MAGRPOTrainer)


def evaluate(arguments) -> int:
    import json

    import torch

    from .evaluation import evaluate_task
    from .tasks import resolve_task

    baseline = arguments.baseline or ("team" if arguments.team else "parallel")
    options = {"source": arguments.task_source} if arguments.task_source else {}
    metrics = evaluate_task(
        resolve_task(arguments.task, **options),
        baseline,
        team=arguments.team,
        model=arguments.model,
        split=arguments.split,
        limit=arguments.limit,
        algorithm=arguments.algorithm,
        max_completion_length=arguments.max_completion_length,
        use_cpu=not torch.cuda.is_available(),
        **vllm_settings(arguments),
    )
    print(json.dumps({"task": arguments.task, "baseline": baseline, **metrics}, indent=2))
    return 0


def vllm_settings(arguments) -> dict[str, Any]:
    """The config fields of `evaluate`'s vLLM flags (none without `--use_vllm`: the config's defaults stay)."""
    if not arguments.use_vllm:
        return {}
    settings = {"use_vllm": True, "vllm_gpu_memory_utilization": arguments.vllm_gpu_memory_utilization}
    if arguments.vllm_max_model_length is not None:
        settings["vllm_max_model_length"] = arguments.vllm_max_model_length
    return settings


def estimate_config(config_path: str, overrides: list[str] = (), prompt_length: int | None = None):
    """The memory planner's `MemoryEstimate` for a `trl-marl train` config on a GPU, from the model's config.json only
    (from the Hub, its cache, or a local folder: `--model_name_or_path` in `overrides`). Raises `OSError` when that
    config cannot be read."""
    import torch

    from .memory import DEFAULT_PROMPT_LENGTH, estimate_memory

    overrides = list(overrides)
    if not torch.cuda.is_available():
        # transformers accepts bf16 without a GPU only with use_cpu, under which trl_marl turns an unset bf16 off;
        # the prediction is for a GPU, where bf16 is on unless the config says otherwise (TRL's default).
        with open(config_path) as file:
            keys = set(yaml.safe_load(file) or {})
        precision_set = keys & {"bf16", "fp16"} or {"--bf16", "--fp16"} & set(overrides)
        overrides = ["--use_cpu", "true", *([] if precision_set else ["--bf16", "true"]), *overrides]
    script_args, args = parse_train_config(config_path, overrides)
    return estimate_memory(
        args,
        model_name_or_path=script_args.model_name_or_path,
        load_in_4bit=script_args.load_in_4bit,
        prompt_length=prompt_length or DEFAULT_PROMPT_LENGTH,
    )


def estimate(arguments, overrides: list[str]) -> int:
    """`trl-marl estimate`: the memory planner's breakdown for a `trl-marl train` config, and whether it fits each
    card size. Reads the model's config.json only (from the Hub, its cache, or a local folder)."""
    try:
        result = estimate_config(arguments.config, overrides, arguments.prompt_length)
    except OSError as error:
        raise SystemExit(
            f"Could not read the model's config: {error}\nThe planner needs only its config.json: go online, or pass "
            "--model_name_or_path a local folder holding it."
        ) from error
    print(result.table(arguments.gpu_memory_gb))
    return 0


def _check_keys(config_path: str, values: dict, dataclass_types: tuple) -> None:
    """Fail on a key that is no field, before anything is built (TRL's parser would first build the config, whose
    own checks could hide the misspelt key)."""
    config_class = dataclass_types[-1]
    known = {f.name for cls in dataclass_types for f in dataclasses.fields(cls)}
    known |= {"env", *config_class.not_applicable}  # the sibling's fields: `parse_train_config` says if they apply
    unknown = sorted(set(values) - known)
    if unknown:
        hints = [
            f"'{key}' (did you mean '{close[0]}'?)"
            if (close := difflib.get_close_matches(key, known, 1))
            else f"'{key}'"
            for key in unknown
        ]
        raise SystemExit(
            f"{config_path}: unknown key(s) {', '.join(hints)}. Keys are {dataclass_types[-1].__name__} / GRPOConfig "
            f"fields, `env`, and {', '.join(f'`{f.name}`' for f in dataclasses.fields(TrainArguments))}."
        )


def _flag_value(arguments: list[str], flag: str) -> str | None:
    return arguments[arguments.index(flag) + 1] if flag in arguments[:-1] else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trl-marl", description="Train teams of LLM agents with TRL.")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="list installed plugins", description="List installed plugins.")
    listing.add_argument("kind", nargs="?", choices=list(GROUPS), help="only this kind of plugin")
    training = commands.add_parser(
        "train",
        help="train a team from a YAML config",
        description="Train a team: CONFIG holds `algorithm` (magrpo or at_grpo), that algorithm's config fields, "
        "`task`, `rewards` and `model_name_or_path`; any field can also be given as --field value after it.",
    )
    training.add_argument("config", help="YAML file")
    evaluating = commands.add_parser(
        "evaluate",
        help="evaluate a saved team or a baseline on a task",
        description="Evaluate a saved team (--team PATH) or a baseline of the untrained base model on a task's split; "
        "prints the task's metrics (team reward and its levels) as JSON.",
    )
    evaluating.add_argument("task", help="task plugin name (`trl-marl list tasks`)")
    evaluating.add_argument("--baseline", default=None, choices=["team", "parallel", "sequential", "single"],
                            help="default: team with --team, else parallel")  # fmt: skip
    evaluating.add_argument("--team", default=None, help="a folder written by save_model")
    evaluating.add_argument("--model", default=None, help="base model of a baseline (default: the embedded model)")
    evaluating.add_argument("--split", default="eval")
    evaluating.add_argument(
        "--algorithm", default="magrpo", choices=["magrpo", "at_grpo"],
        help="at_grpo: one episode per problem, one candidate per turn; adds episodes/success_rate",
    )  # fmt: skip
    evaluating.add_argument("--task_source", default=None, help="the task's data source, e.g. hub (default: offline)")
    evaluating.add_argument("--limit", type=int, default=None, help="only the first N problems")
    evaluating.add_argument("--max_completion_length", type=int, default=256)
    evaluating.add_argument("--use_vllm", action="store_true", help="generate with vLLM, one LoRA per agent")
    evaluating.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3,
                            help="with --use_vllm: vLLM's share of the GPU memory (TRL's default)")  # fmt: skip
    evaluating.add_argument("--vllm_max_model_length", type=int, default=None,
                            help="with --use_vllm: vLLM's context length (default: the model's)")  # fmt: skip
    estimating = commands.add_parser(
        "estimate",
        help="predict a training config's peak GPU memory",
        description="Predict the peak GPU memory of `trl-marl train CONFIG` (memory planner: base, adapters, "
        "optimizer, activations, KV cache) from the model's config.json alone; --field value overrides as in train. "
        "With use_vllm, vLLM's engine (its pool of vllm_gpu_memory_utilization x the card, and the KV cache left in "
        "it) beside the trainer, and why a card does not fit.",
    )
    estimating.add_argument("config", help="YAML file of `trl-marl train`")
    estimating.add_argument("--prompt_length", type=int, default=512, help="longest prompt in tokens (default 512)")
    estimating.add_argument("--gpu_memory_gb", type=float, nargs="*", default=[16, 24],
                            help="card sizes to check, in GiB (vLLM's pool is a share of each)")  # fmt: skip
    arguments, overrides = parser.parse_known_args(argv)
    if arguments.command == "estimate":
        return estimate(arguments, overrides)
    if arguments.command == "evaluate":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        return evaluate(arguments)
    if arguments.command == "list":
        if overrides:
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        return list_plugins([arguments.kind] if arguments.kind else list(GROUPS))
    return train(arguments.config, overrides)


if __name__ == "__main__":
    sys.exit(main())
