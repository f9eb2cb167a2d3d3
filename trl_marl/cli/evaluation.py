"""Evaluate a team on a task's split, and the MAGRPO paper's baselines, with the task's own rewards and metrics.

`evaluate_task(task, baseline=...)` runs one of:

- ``"team"``: a trained team (a folder written by `save_model`, given as `team=`), as it was trained;
- ``"parallel"``: the untrained base model in every role, all agents acting at once (the `parallel` scheduler);
- ``"sequential"``: the untrained base model in every role, each agent seeing the earlier agents' answers (a
  pipeline: the `sequential` scheduler);
- ``"single"``: one agent doing the whole job: the base model with every role's instructions at once, its one answer
  standing in for every agent's when the team reward scores it.

It builds the algorithm's trainer (`MAGRPOTrainer` or `ATGRPOTrainer`) on the split and returns
`trainer.evaluate()`'s metrics without the `eval_` prefix (the team reward `reward`, the reward's logged levels such
as `coding/pass_at_1` or `rewards/summary_reward/style`) and without the ones that describe training only (the loss,
clipping, advantages, epoch and token count: `metrics.TRAINING_METRICS`).
"""

from __future__ import annotations

import copy
import functools
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from ..agents import BASE_KEYS
from ..tasks import Task, resolve_task, task_defaults
from ..trainers.metrics import is_training_metric
from .train import EVALUATED_ALGORITHMS

BASELINES = ("team", "parallel", "sequential", "single")
SPLITS = ("train", "eval")  # what Task.dataset(split) takes
SINGLE_AGENT = "solo"


def single_agent_prompt(task: Task) -> str:
    """The one agent's role in the ``"single"`` baseline: every agent's role, in order."""
    roles = [f"As {agent['name']}: {agent.get('system_prompt', '')}".strip() for agent in task.agents]
    return "You do the whole job of a team alone.\n" + "\n".join(roles)


def _as_team_reward(func, agent_names: list[str]):
    """A team reward scoring a lone agent's answer as every agent's answer."""

    @functools.wraps(func)
    def reward(prompts, completions, **kwargs):
        team = [dict.fromkeys(agent_names, completion[SINGLE_AGENT]) for completion in completions]
        return func(prompts=prompts, completions=team, **kwargs)

    return reward


def evaluate_task(
    task: str | Task,
    baseline: str = "team",
    team: str | os.PathLike | None = None,
    model: str | None = None,
    split: str = "eval",
    limit: int | None = None,
    algorithm: str = "magrpo",
    base_model: str | None = None,
    base_models: dict[str, str] | None = None,
    load_in_4bit: bool | None = None,
    dtype: str | None = None,
    tools: Sequence[Callable] | None = None,
    environment_factory: Callable | None = None,
    **config: Any,
) -> dict[str, float]:
    """Evaluate on `task`'s `split` (its first `limit` rows). `team` (for ``baseline="team"``): a saved team folder
    or the Hub id of a pushed team; `base_model` and `base_models` say where its bases are on this machine, as
    `load_team`'s do (the first agent's base; the others by the names team.json records); `load_in_4bit` and `dtype`,
    when given, how every base loads, as `load_team`'s do (else each base as its agents recorded, and the first base,
    which records none, unquantized in its checkpoint's dtype: pass a 4-bit team's again). `model`: the base model of
    the baselines (default: the embedded default model); a team sits on the bases its team.json names, so `model` with
    ``baseline="team"`` is refused (pass `base_model`). `config`: `MAGRPOConfig` fields
    (e.g. `max_completion_length`, `temperature`, `use_cpu`; `use_vllm=True` with `vllm_gpu_memory_utilization` and
    `vllm_max_model_length` generates through vLLM as training does, the engine closed afterwards). A team is
    evaluated with the generation settings its team.json records (`team_settings`) except those `config` sets, on
    its bases loaded as `load_team` loads them (`team.load_saved_bases`: each base at the precision its agents
    recorded, each adapter from its own saved config), and with exactly the tools and environment it trained with
    (`team.saved_tools`: the trainer's `tools=`, each agent's own `tools`, the environment factory, or none when it
    trained without one, even on a task that has one); a function in `tools` stands in for the recorded tools of its
    `__name__` that cannot be rebuilt here (no importable name: a lambda, a local function; or a name that does not
    import here), never for one that imports, and `environment_factory` for the recorded factory, as `load_team`'s
    do. A tool or factory that cannot be rebuilt is a `team.saved_tools.UnrebuiltTool` (a ValueError naming it, its
    agent and what to pass), raised before any model loads.

    `algorithm="magrpo"` scores MAGRPO's tree of joint actions (two samples per agent and node): the mean team reward
    over them. `algorithm="at_grpo"` plays each problem as one AT-GRPO episode with a single candidate per agent and
    turn (no choice among candidates, whose rewards may see the answer: the figures are not best-of-K); its
    `reward` averages every agent's turn, `episodes/team_reward` is the team reward each episode ended on, and
    `episodes/success_rate` is added for tasks that define success."""
    from ..team.default_model import default_model_path
    from ..team.hub import resolve_team_folder
    from ..team.saved import read_team_file
    from ..team.saved_bases import load_saved_bases
    from ..team.saved_tools import saved_tools
    from .train import algorithm_classes

    if baseline not in BASELINES:
        raise ValueError(f"`baseline` must be one of {list(BASELINES)}, got {baseline!r}.")
    if algorithm not in EVALUATED_ALGORITHMS:
        raise ValueError(f"`algorithm` must be one of {list(EVALUATED_ALGORITHMS)}, got {algorithm!r}.")
    if split not in SPLITS:
        raise ValueError(f"`split` must be one of {list(SPLITS)} (a task's splits), got {split!r}.")
    if (baseline == "team") != (team is not None):
        raise ValueError("Pass `team=` (a folder written by save_model) with baseline='team', and only then.")
    if baseline == "team" and model is not None:
        raise ValueError(
            f"`model` ({model!r}) is the base model of a baseline; a team sits on the bases its team.json names. To "
            "say where a team's base is on this machine, pass `base_model=` (the first agent's base) or "
            "`base_models=` (by the names team.json records)."
        )
    if baseline != "team" and (base_model is not None or base_models):
        raise ValueError(
            "`base_model` / `base_models` say where a saved team's bases are (baseline='team'); a baseline's base "
            "model is `model=`."
        )
    if baseline != "team" and (tools or environment_factory is not None):
        raise ValueError(
            "`tools` / `environment_factory` stand in for a saved team's tools (baseline='team'); a baseline plays "
            "with its task's agents and environment."
        )
    if baseline != "team" and (load_in_4bit is not None or dtype is not None):
        raise ValueError(
            "`load_in_4bit` / `dtype` say how a saved team's bases load (baseline='team'); a baseline's base model "
            "loads by `model_init_kwargs` (e.g. model_init_kwargs={'dtype': 'bfloat16'})."
        )
    task = resolve_task(task)
    dataset = task.dataset(split)
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    candidates = 1 if algorithm == "at_grpo" else 2
    settings = {**task_defaults(task), "num_generations": 2, "num_generations_eval": candidates, "report_to": "none"}
    settings["per_device_eval_batch_size"] = 2
    reward_funcs = list(task.reward_funcs)
    other_bases = None  # a team's bases after the first, loaded, by their recorded names
    trainer_tools = {}  # a team's: the trainer's `tools=` and environment factory it trained with
    if baseline == "team":
        team = resolve_team_folder(team)  # a folder, or the Hub id of a pushed team
        spec = read_team_file(team)
        trained = saved_tools(spec, str(team), task, tools, environment_factory)  # before any model loads
        settings.update(team_settings(spec, trained.agent_tools))
        trainer_tools = {"tools": trained.tools or None, "environment_factory": trained.environment_factory}
        if trained.environment_factory is None and getattr(task, "environment_factory", None) is not None:
            # trained without an environment: the trainer must not take the task's either
            task = copy.copy(task)
            task.environment_factory = None
        # Every base loaded as `load_team` loads it (precision, each adapter from its own saved config), then handed to
        # the trainer as it is: the first as its model, the others for their agents' recorded `model` names.
        first, *others = load_saved_bases(
            team, spec, load_in_4bit=load_in_4bit, dtype=dtype, base_model=base_model, base_models=base_models
        )
        model, other_bases = first.model, {base.name: base.model for base in others} or None
    elif baseline in ("parallel", "sequential"):
        settings["scheduler"] = baseline
    else:
        names = [agent["name"] for agent in task.agents]
        settings.update(agents=[{"name": SINGLE_AGENT, "system_prompt": single_agent_prompt(task)}], num_turns=1)
        settings["scheduler"] = "parallel"
        reward_funcs = [_as_team_reward(resolve_reward(func), names) for func in reward_funcs]
    settings.update(config)
    with tempfile.TemporaryDirectory() as output_dir:
        config_class, trainer_class = algorithm_classes(algorithm)
        args = config_class(output_dir=settings.pop("output_dir", output_dir), **settings)
        trainer = trainer_class(
            model if model is not None else default_model_path(),
            reward_funcs,
            args=args,
            train_dataset=dataset,
            eval_dataset=dataset,
            task=task,  # its transition, and its environment state if it keeps one
            base_models=other_bases,
            **trainer_tools,
        )
        try:
            metrics = trainer.evaluate()
        finally:
            if args.use_vllm:  # free the engine: a later evaluation or trainer in this process starts its own
                trainer.vllm_generation.close()
    metrics = {key.removeprefix("eval_"): value for key, value in metrics.items()}
    return {key: value for key, value in metrics.items() if not is_training_metric(key)}


def team_settings(spec: dict, agent_tools: Sequence[list | None] | None = None) -> dict[str, Any]:
    """The config fields a saved team is evaluated with, from its `team.json` (`spec`): its agents, their roles and
    their own tools (`agent_tools`, each agent's as `team.saved_tools` rebuilt them; else as team.json names them),
    adapter mode and turns, and how it generated in training (`team.GENERATION_FIELDS`: completion length, sampling,
    chat template arguments, tool-calling rounds). `evaluate_task`'s `config` overrides any of them; a field that an
    older team.json lacks keeps the config's default."""
    from ..team.saved import GENERATION_FIELDS

    if agent_tools is None:
        agent_tools = [agent.get("tools") for agent in spec["agents"]]
    agents = [
        {
            "name": agent["name"],
            "system_prompt": agent["system_prompt"],
            **{k: agent[k] for k in BASE_KEYS if k in agent},
            **({"tools": list(tools)} if tools is not None else {}),
        }
        for agent, tools in zip(spec["agents"], agent_tools)
    ]
    recorded = {name: spec[name] for name in GENERATION_FIELDS if name in spec}
    return {"agents": agents, "adapter_mode": spec["adapter_mode"], "num_turns": spec["num_turns"], **recorded}


def resolve_reward(func):
    """A reward plugin by name, or the function itself."""
    if isinstance(func, str):
        from ..registry import load_plugin

        return load_plugin("rewards", func)
    return func
