"""The `trl-marl` command.

    trl-marl list [rewards|tasks|schedulers]      the installed plugins: name, source distribution, one-line doc
    trl-marl train [CONFIG.yaml | --config CONFIG.yaml] [--field value ...]
                                                  train a team, as `trl grpo --config` trains one policy: the YAML
                                                  holds `algorithm` (magrpo, at_grpo, iac or maac), its config
                                                  fields (MAGRPOConfig, ATGRPOConfig, IACConfig, MAACConfig),
                                                  `task` (and `task_source`) or TRL's `dataset_name` /
                                                  `dataset_config` / `dataset_train_split` / `dataset_test_split`
                                                  with `rewards`, `model_name_or_path` and `load_in_4bit`; flags
                                                  override the file; `--help` lists every field
    trl-marl evaluate TASK [--baseline B] [--team PATH [--base_model M] [--base_models NAME=PATH ...]
                      [--load_in_4bit] [--dtype D]] [--model M]
                      [--limit N] [--split S] [--task_source SRC]
                      [--algorithm magrpo|at_grpo] [--use_vllm [--vllm_gpu_memory_utilization U]]
                      [--max_completion_length N] [--temperature T] [--top_p P] [--top_k K] [--min_p P]
                      [--repetition_penalty R]
                                                  a saved team or a baseline (single, parallel, sequential) on a task;
                                                  prints the task's metrics as JSON; a team generates as its team.json
                                                  records unless a flag says otherwise; --base_model and
                                                  --base_models say where a team's bases are, --load_in_4bit and
                                                  --dtype how they load, as load_team's
    trl-marl estimate CONFIG.yaml [--prompt_length N] [--gpu_memory_gb 16 24] [--model_config NAME=FOLDER ...]
                                                  predicted peak memory of a `train` config on one GPU (in RAM with
                                                  use_cpu: true; no weights load), each base of the team listed,
                                                  with use_vllm the vLLM engine's pool and KV cache on each card
    trl-marl serve TEAM [--host H] [--port P] [--api_key_file F] [--allowed_hosts H,..] [--allowed_origins O,..]
                        [--load_in_4bit] [--dtype D]
                        [--captured_decode auto|on|off|cuda-graphs|compiled] [--max_batch_rows N]
                        [--chunk_tokens N] [--max_tokens N]
                        [--use_vllm [--vllm_gpu_memory_utilization U] [--vllm_max_model_length N]]
                                                  a saved team behind an OpenAI-compatible endpoint (each agent a
                                                  model); prints its base URL; needs the `serve` extra

A mistake the command can see (an unknown flag, key or plugin, no data, a dataset without a `prompt` column, a team
whose tools cannot be rebuilt here) ends it with one line on stderr and exit status 2, before any model loads where it
can be known then; `--debug` (or `TRL_MARL_DEBUG=1`) shows the traceback instead.
"""

import argparse
import os
import sys
from typing import Any

from ..agents import BASE_DTYPES
from ..registry import GROUPS, PluginError, did_you_mean, discover
from .train import EVALUATED_ALGORITHMS, TrainArguments, UsageError, flag_value, parse_train_config, read_config, train

__all__ = ["TrainArguments", "UsageError", "main", "parse_train_config"]

# `evaluate`'s flags for the generation settings a saved team records in team.json (their defaults there).
GENERATION_FLAGS = {
    "max_completion_length": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
}
BASELINE_COMPLETION_LENGTH = 256  # a baseline's completions, unless --max_completion_length says otherwise


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


def evaluate(arguments) -> int:
    import json

    import torch

    from ..tasks import resolve_task
    from ..team.hub import resolve_team_folder
    from ..team.saved import read_team_file
    from ..team.saved_bases import find_bases
    from ..team.saved_tools import UnrebuiltTool
    from .evaluation import evaluate_task

    baseline = arguments.baseline or ("team" if arguments.team else "parallel")
    if (baseline == "team") != (arguments.team is not None):
        raise UsageError("trl-marl evaluate: --team PATH goes with --baseline team (its default), and only with it.")
    if arguments.team is not None and arguments.model is not None:
        raise UsageError(
            "trl-marl evaluate: --model is a baseline's base model; a team sits on the bases its team.json names. "
            "Say where they are with --base_model PATH (the first agent's) or --base_models NAME=PATH."
        )
    if arguments.team is None and (arguments.base_model is not None or arguments.base_models):
        raise UsageError("trl-marl evaluate: --base_model and --base_models go with --team; a baseline's is --model.")
    if arguments.team is None and (arguments.load_in_4bit or arguments.dtype is not None):
        raise UsageError("trl-marl evaluate: --load_in_4bit and --dtype set how a team's bases load (with --team).")
    base_models = {}
    for entry in arguments.base_models or []:
        name, _, where = entry.partition("=")
        if not name or not where:
            raise UsageError(
                f"trl-marl evaluate: --base_models takes NAME=PATH (a name team.json records), got {entry!r}."
            )
        base_models[name] = where
    options = {"source": arguments.task_source} if arguments.task_source else {}
    try:
        task = resolve_task(arguments.task, **options)
        team = None
        if arguments.team is not None:  # a folder or Hub id without a team, or a base not here, fails before any load
            team = resolve_team_folder(arguments.team)
            find_bases(team, read_team_file(team), arguments.base_model, base_models)
    except (PluginError, TypeError, FileNotFoundError, ValueError) as error:
        raise UsageError(str(error)) from None
    # Only the generation flags given: a team's own settings (its team.json) are the defaults of the others.
    generation = {name: getattr(arguments, name) for name in GENERATION_FLAGS if getattr(arguments, name) is not None}
    if team is None:
        generation.setdefault("max_completion_length", BASELINE_COMPLETION_LENGTH)
    try:
        metrics = evaluate_task(
            task,
            baseline,
            team=team,
            model=arguments.model,
            base_model=arguments.base_model,
            base_models=base_models or None,
            load_in_4bit=arguments.load_in_4bit or None,
            dtype=arguments.dtype,
            split=arguments.split,
            limit=arguments.limit,
            algorithm=arguments.algorithm,
            use_cpu=not torch.cuda.is_available(),
            **generation,
            **vllm_settings(arguments),
        )
    except UnrebuiltTool as error:  # raised before any model loads
        passing = (
            "pass it again from Python (the command cannot pass a function or class): "
            f"trl_marl.cli.evaluation.evaluate_task(..., {error.keyword}={error.value})"
        )
        raise UsageError(f"trl-marl evaluate: {error.telling(passing)}") from None
    print(json.dumps({"task": arguments.task, "baseline": baseline, **metrics}, indent=2))
    return 0


def add_vllm_flags(parser) -> None:
    """`--use_vllm` and the vLLM engine's settings (`evaluate`, `serve`)."""
    parser.add_argument("--use_vllm", action="store_true", help="generate with vLLM, one LoRA per agent")
    parser.add_argument("--vllm_gpu_memory_utilization", type=float, default=0.3,
                        help="with --use_vllm: vLLM's share of the GPU memory (TRL's default)")  # fmt: skip
    parser.add_argument("--vllm_max_model_length", type=int, default=None,
                        help="with --use_vllm: vLLM's context length (default: the model's)")  # fmt: skip


def vllm_settings(arguments) -> dict[str, Any]:
    """The config fields of `evaluate`'s vLLM flags (none without `--use_vllm`: the config's defaults stay)."""
    if not arguments.use_vllm:
        return {}
    settings = {"use_vllm": True, "vllm_gpu_memory_utilization": arguments.vllm_gpu_memory_utilization}
    if arguments.vllm_max_model_length is not None:
        settings["vllm_max_model_length"] = arguments.vllm_max_model_length
    return settings


def serve(arguments) -> int:
    """`trl-marl serve`: the team (a folder or Hub id, checked before any model loads) served until interrupted."""
    from ..generation.decode_support import captured_decode_setting
    from ..serving.access import api_key_from
    from ..serving.server import require_serving_packages, serve_forever
    from ..team.hub import resolve_team_folder
    from ..team.saved import read_team_file

    try:
        require_serving_packages()
        api_key = api_key_from(arguments.api_key, arguments.api_key_file)
        team = resolve_team_folder(arguments.team)
        read_team_file(team)
    except (ImportError, FileNotFoundError, ValueError) as error:
        raise UsageError(f"trl-marl serve: {error}") from None
    for name in ("max_batch_rows", "chunk_tokens", "max_tokens", "max_body_bytes", "max_request_rows"):
        value = getattr(arguments, name)
        if value is not None and value < 1:
            raise UsageError(f"trl-marl serve: --{name} must be at least 1, got {value}.")
    load_options = {"captured_decode": captured_decode_setting(arguments.captured_decode)}
    if arguments.load_in_4bit:
        load_options["load_in_4bit"] = True
    for name in ("dtype", "base_model"):
        if getattr(arguments, name) is not None:
            load_options[name] = getattr(arguments, name)
    load_options.update(vllm_settings(arguments))
    serve_forever(
        team,
        host=arguments.host,
        port=arguments.port,
        api_key=api_key,
        allowed_hosts=split_list(arguments.allowed_hosts),
        allowed_origins=split_list(arguments.allowed_origins),
        max_batch_rows=arguments.max_batch_rows,
        chunk_tokens=arguments.chunk_tokens,
        max_tokens=arguments.max_tokens,
        max_body_bytes=arguments.max_body_bytes,
        max_request_rows=arguments.max_request_rows,
        log_level=arguments.log_level,
        **load_options,
    )
    return 0


def estimate_config(
    config_path: str,
    overrides: list[str] = (),
    prompt_length: int | None = None,
    model_configs: list[str] | None = None,
):
    """The memory planner's `MemoryEstimate` for a `trl-marl train` config on the device it trains on (one GPU; the
    CPU's RAM with `use_cpu: true`), from the model's config.json only (from the Hub, its cache, or a local folder:
    `--model_name_or_path` in `overrides`), and for agents on other bases each of theirs (`model_configs`:
    "NAME=FOLDER" reads the config of the model an agent names NAME from FOLDER). Raises `OSError` when a config
    cannot be read."""
    import torch
    from transformers import AutoConfig

    from ..memory import DEFAULT_PROMPT_LENGTH, estimate_team_memory

    overrides = list(overrides)
    values = read_config(config_path)
    given = flag_value(overrides, "--use_cpu")
    if "--use_cpu" in overrides and (given is None or given.startswith("--")):
        given = "true"  # a bare --use_cpu
    on_cpu = str(values.get("use_cpu", False) if given is None else given).lower() in ("true", "1", "yes")
    if not on_cpu and not torch.cuda.is_available():
        # transformers accepts bf16 without a GPU only with use_cpu, under which trl_marl turns an unset bf16 off;
        # the prediction is for a GPU, where bf16 is on unless the config says otherwise (TRL's default).
        precision_set = set(values) & {"bf16", "fp16"} or {"--bf16", "--fp16"} & set(overrides)
        overrides = [*overrides, "--use_cpu", "true", *([] if precision_set else ["--bf16", "true"])]
    script_args, args = parse_train_config(config_path, overrides, require_data=False)
    named = {}
    for entry in model_configs or []:
        name, _, folder = entry.partition("=")
        if not name or not folder:
            raise UsageError(f"trl-marl estimate: --model_config takes NAME=FOLDER, got {entry!r}.")
        named[name] = AutoConfig.from_pretrained(folder)
    unknown = sorted(set(named) - {agent.get("model") for agent in args.agents})
    if unknown:
        raise UsageError(
            f"trl-marl estimate: --model_config names {unknown}, which no agent's `model` names "
            f"(they name {sorted({a['model'] for a in args.agents if 'model' in a}) or 'none'})."
        )
    return estimate_team_memory(
        args,
        model_name_or_path=script_args.model_name_or_path,
        load_in_4bit=script_args.load_in_4bit,
        prompt_length=prompt_length or DEFAULT_PROMPT_LENGTH,
        device="cpu" if on_cpu else "cuda",
        model_configs=named,
    )


def estimate(arguments, overrides: list[str]) -> int:
    """`trl-marl estimate`: the memory planner's breakdown for a `trl-marl train` config, and whether it fits each
    card size. Reads the model's config.json only (from the Hub, its cache, or a local folder)."""
    try:
        result = estimate_config(arguments.config, overrides, arguments.prompt_length, arguments.model_config)
    except OSError as error:
        raise UsageError(
            f"Could not read the model's config: {error} The planner needs only its config.json: go online, or pass "
            "--model_name_or_path a local folder holding it."
        ) from error
    print(result.table(arguments.gpu_memory_gb))
    return 0


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes are one-line `UsageError`s like the rest of the command's."""

    def error(self, message: str):
        raise UsageError(message if self.prog == "trl-marl" else f"{self.prog}: {message}")


def split_list(value: str) -> tuple[str, ...]:
    """A comma-separated option's items, blanks dropped."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def check_arguments(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """Fail on arguments a command does not take, suggesting the closest of its flags."""
    if extra:
        flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
        raise UsageError(f"{parser.prog}: unknown argument '{extra[0]}'{did_you_mean(extra[0].split('=')[0], flags)}.")


def main(argv: list[str] | None = None) -> int:
    """The `trl-marl` command: its exit status (2 after a mistake in the command line, the config or its data)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # A bare `--debug` is ours; `--debug underflow_overflow` is TrainingArguments' field of that name.
    ours = [i for i, a in enumerate(argv) if a == "--debug" and (i == 0 or not is_debug_option(argv[i + 1 : i + 2]))]
    debug = bool(ours) or os.environ.get("TRL_MARL_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")
    argv = [a for i, a in enumerate(argv) if i not in ours]
    try:
        return run(argv)
    except UsageError as error:
        if debug:
            raise
        print(f"trl-marl: error: {error}", file=sys.stderr)
        return 2


def is_debug_option(following: list[str]) -> bool:
    """Whether what follows a `--debug` is a value of TrainingArguments' `debug` field (not a flag or a config)."""
    return bool(following) and following[0][:1] != "-" and not following[0].endswith((".yaml", ".yml"))


def run(argv: list[str]) -> int:
    parser = ArgumentParser(prog="trl-marl", description="Train teams of LLM agents with TRL.")
    parser.add_argument("--debug", action="store_true", help="show an error's traceback instead of one line")
    commands = parser.add_subparsers(dest="command", required=True)
    listing = commands.add_parser("list", help="list installed plugins", description="List installed plugins.")
    listing.add_argument("kind", nargs="?", choices=list(GROUPS), help="only this kind of plugin")
    # `train` parses its own arguments (TRL's parser over every field: `trl-marl train --help`); here for the index.
    commands.add_parser("train", help="train a team from a YAML config and --field value flags", add_help=False)
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
    evaluating.add_argument("--base_model", default=None,
                            help="with --team: where its first agent's base is (a folder or Hub id)")  # fmt: skip
    evaluating.add_argument("--base_models", action="append", default=None, metavar="NAME=PATH",
                            help="with --team: where the base team.json records as NAME is (repeatable)")  # fmt: skip
    evaluating.add_argument("--load_in_4bit", action="store_true",
                            help="with --team: every base in 4-bit NF4 (default: as team.json records)")  # fmt: skip
    evaluating.add_argument("--dtype", default=None, choices=list(BASE_DTYPES),
                            help="with --team: every base's dtype (default: as team.json records)")  # fmt: skip
    evaluating.add_argument("--split", default="eval", choices=["train", "eval"], help="the task's split to score")
    evaluating.add_argument(
        "--algorithm", default="magrpo", choices=list(EVALUATED_ALGORITHMS),
        help="at_grpo: one episode per problem, one candidate per turn; adds episodes/success_rate",
    )  # fmt: skip
    evaluating.add_argument("--task_source", default=None, help="the task's data source, e.g. hub (default: offline)")
    evaluating.add_argument("--limit", type=int, default=None, help="only the first N problems")
    for name, kind in GENERATION_FLAGS.items():
        otherwise = BASELINE_COMPLETION_LENGTH if name == "max_completion_length" else "MAGRPOConfig's"
        help_text = f"default: a team's own (its team.json), else {otherwise}"
        evaluating.add_argument(f"--{name}", type=kind, default=None, help=help_text)
    add_vllm_flags(evaluating)
    estimating = commands.add_parser(
        "estimate",
        help="predict a training config's peak memory (one GPU; the RAM with use_cpu)",
        description="Predict the peak memory of `trl-marl train CONFIG` on one GPU, or in RAM with use_cpu: true "
        "(memory planner: base, adapters, "
        "optimizer, activations, KV cache) from the model's config.json alone; --field value overrides as in train. "
        "With use_vllm, vLLM's engine (its pool of vllm_gpu_memory_utilization x the card, and the KV cache left in "
        "it) beside the trainer, and why a card does not fit.",
    )
    estimating.add_argument("config", nargs="?", help="YAML file of `trl-marl train` (or --config FILE)")
    estimating.add_argument("--prompt_length", type=int, default=512, help="longest prompt in tokens (default 512)")
    estimating.add_argument("--gpu_memory_gb", type=float, nargs="*", default=[16, 24],
                            help="card sizes to check, in GiB (vLLM's pool is a share of each)")  # fmt: skip
    estimating.add_argument("--model_config", action="append", default=None, metavar="NAME=FOLDER",
                            help="an agent's own base: read the config.json of the model it names NAME from FOLDER "
                                 "(offline); repeatable")  # fmt: skip
    serving = commands.add_parser(
        "serve",
        help="serve a saved team behind an OpenAI-compatible endpoint",
        description="Serve a team saved by save_model behind an OpenAI-compatible endpoint: each agent is a model "
        "(GET /v1/models), requests of any agents are generated together in routed calls. Prints the base URL "
        "(http://HOST:PORT/v1) once listening; runs until interrupted. Needs the serve extra (FastAPI, uvicorn).",
    )
    serving.add_argument("team", help="a folder written by save_model, or a pushed team's Hub id")
    serving.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    serving.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    serving.add_argument("--api_key_file", default=None,
                         help="require `Authorization: Bearer KEY` on /v1 requests, KEY the file's first line "
                              "(without it or --api_key: $TRL_MARL_API_KEY; none of them: no key)")  # fmt: skip
    serving.add_argument("--api_key", default=None,
                         help="the key itself (every local user can read it in the process list: prefer "
                              "--api_key_file or $TRL_MARL_API_KEY)")  # fmt: skip
    serving.add_argument(
        "--allowed_hosts",
        default="",
        help="comma-separated host names the server answers to besides its address (* for any)",
    )
    serving.add_argument(
        "--allowed_origins",
        default="",
        help="comma-separated web origins whose pages may call it (* for any; default none)",
    )
    serving.add_argument("--load_in_4bit", action="store_true", help="load the base model in 4-bit NF4")
    serving.add_argument("--dtype", default=None, choices=list(BASE_DTYPES),
                         help="the base model's dtype (default: as the team recorded)")  # fmt: skip
    serving.add_argument("--base_model", default=None, help="where the base model is, if not where team.json says")
    serving.add_argument("--captured_decode", default="auto",
                         choices=["auto", "on", "off", "true", "false", "cuda-graphs", "compiled"],
                         help="generate through the captured decode step (auto: CUDA graphs on CUDA)")  # fmt: skip
    serving.add_argument("--max_batch_rows", type=int, default=16, help="most rows in one routed generate call")
    serving.add_argument("--chunk_tokens", type=int, default=16,
                         help="a call yields to waiting requests after this many tokens")  # fmt: skip
    serving.add_argument("--max_tokens", type=int, default=None,
                         help="completion length of a request that sets none (default: team.json's)")  # fmt: skip
    serving.add_argument("--max_body_bytes", type=int, default=None, help="largest request body (default 4 MiB)")
    serving.add_argument(
        "--max_request_rows",
        type=int,
        default=None,
        help="most completions one request may ask for, prompts x n (default 128)",
    )
    serving.add_argument("--log_level", default="warning", help="uvicorn's log level")
    add_vllm_flags(serving)
    if argv[:1] == ["train"]:
        return train_command(argv[1:])
    if argv[:1] == ["estimate"]:  # `--config FILE` as the positional CONFIG
        config, rest = config_argument(None, argv[1:], "estimate")
        argv = ["estimate", config, *rest] if config is not None else argv
    arguments, overrides = parser.parse_known_args(argv)
    if arguments.command == "estimate":
        if arguments.config is None:
            raise UsageError("trl-marl estimate: give the YAML file of a `trl-marl train` run, as CONFIG or --config.")
        return estimate(arguments, overrides)
    check_arguments({"evaluate": evaluating, "serve": serving}.get(arguments.command, listing), overrides)
    if arguments.command == "evaluate":
        return evaluate(arguments)
    if arguments.command == "serve":
        return serve(arguments)
    return list_plugins([arguments.kind] if arguments.kind else list(GROUPS))


def train_command(arguments: list[str]) -> int:
    """`trl-marl train [CONFIG] [--config CONFIG] [--field value ...]`."""
    config = None
    if arguments and not arguments[0].startswith("-"):
        config, arguments = arguments[0], arguments[1:]
    return train(*config_argument(config, arguments, "train"))


def config_argument(config: str | None, arguments: list[str], command: str) -> tuple[str | None, list[str]]:
    """`(config file, the other arguments)`: the file given as CONFIG or as `--config CONFIG` (TRL's form)."""
    for i, argument in enumerate(arguments):
        if argument == "--config" or argument.startswith("--config="):
            given = argument.split("=", 1)[1] if "=" in argument else next(iter(arguments[i + 1 : i + 2]), None)
            if given is None or config is not None:
                raise UsageError(f"trl-marl {command}: give one config file, as CONFIG or as --config CONFIG.")
            return given, arguments[:i] + arguments[i + (1 if "=" in argument else 2) :]
    return config, arguments


if __name__ == "__main__":
    sys.exit(main())
