"""The tools and the environment a team trained with: recorded in `team.json`, and rebuilt for `load_team` (`Team.run`,
`Team.play`) and `evaluate_task`, so that a saved team is played and evaluated with exactly what it trained with.

`team.json` records (`tools_record`, beside the agents' entries):

- `tools`: the trainer's `tools=` (every agent's), each by its importable name (`"package.module:function"`);
- `environment_factory`: the factory of the episodes' environment (the trainer's `environment_factory=`, or its task's)
  by importable name, or `"none"` when the team trained without an environment, even on a task that has one;
- each agent's own `tools` entry as it was given: functions by importable name, the environment's methods by their
  names (`[]`: none; no entry: all of the environment's).

A function or class without an importable name (a lambda, a function or class defined inside a function, one typed
into an interactive session) is recorded as `{"name": <its __name__>, "importable": false}`: rebuilding it is an error
naming it (and its agent) that says to pass it again (`tools=[...]`, `environment_factory=` of `load_team` and
`evaluate_task`).

A `team.json` written before these fields (no `environment_factory`) keeps loading: its agents' recorded `tools` are
kept, no trainer `tools=` (it did not record them), and its task's environment when the task has one (what evaluation
used then), with a warning saying so.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..generation.tool_calling import (
    TeamTools,
    ToolCalling,
    is_importable,
    prepare_tool_tokenizer,
    resolve_tool,
)
from .base_generation import tokenize_text_prompts
from .importable import import_by_name, importable_name

logger = logging.getLogger("trl_marl")

NO_ENVIRONMENT = "none"  # `environment_factory` of a team that trained without an environment


def recorded_function(func: Callable | str) -> str | dict:
    """How `team.json` names a tool or an environment factory: a name as it was given (an importable name, an
    environment method's), a function by its importable name, else `{"name": <its __name__>, "importable": False}`."""
    if isinstance(func, str):
        return func
    name = importable_name(func)
    if name is not None:
        return name
    return {"name": getattr(func, "__name__", None) or type(func).__name__, "importable": False}


def tools_record(tools: Sequence[Callable] | None, environment_factory: Callable | None) -> dict:
    """The team's fields of `team.json`: the trainer's `tools=` and its environment factory (`"none"` without one)."""
    factory = NO_ENVIRONMENT if environment_factory is None else recorded_function(environment_factory)
    return {"tools": [recorded_function(tool) for tool in tools or []], "environment_factory": factory}


def agent_tools_record(agent: dict) -> dict:
    """An agent's `tools` entry as `team.json` records it (nothing when it has none)."""
    if agent.get("tools") is None:
        return {}
    return {"tools": [recorded_function(tool) for tool in agent["tools"]]}


@dataclass
class SavedTools:
    """What a saved team trained with, rebuilt: the trainer's `tools` (functions), each agent's own `tools` entry
    (functions and environment method names; None: no entry) and the environment factory (None: none)."""

    tools: list[Callable]
    agent_tools: list[list | None]
    environment_factory: Callable | None

    @property
    def calls_tools(self) -> bool:
        """Whether the team trained with tools: the trainer's `tools=`, an environment, or an agent's own tools."""
        return bool(self.tools or self.environment_factory or any(self.agent_tools))


def saved_tools(
    spec: dict,
    where: str,
    task: Any = None,
    tools: Sequence[Callable] | None = None,
    environment_factory: Callable | None = None,
) -> SavedTools:
    """The tools and environment the team of `spec` (its team.json; `where`: the folder, for messages) trained with.

    Args:
        task: the team's task, when loadable: its environment for a team.json that did not record one.
        tools: functions given again, standing in for the recorded tools of the same name (`__name__`), in the
            trainer's `tools` and in every agent's: needed for those team.json could not name by import path.
        environment_factory: given again, it stands in for the recorded one.

    Raises:
        ValueError: a recorded tool or factory has no importable name and is not given again, or its name does not
            import here; a given tool replaces none of the recorded ones. The message names the agent and the tool.
    """
    given = {tool.__name__: tool for tool in tools or []}
    used = set()

    def rebuild(tool, whose: str) -> Callable | str:
        name = tool.get("name") if isinstance(tool, dict) else tool
        if isinstance(name, str) and (isinstance(tool, dict) or is_importable(name)):
            short = name.rpartition(":")[2].rpartition(".")[2]
            if short in given:
                used.add(short)
                return given[short]
        if tool is None or isinstance(tool, dict):
            shown = f"the tool {name!r}" if name else "a tool"
            raise ValueError(
                f"The team in {where} trained {whose} with {shown}, which has no importable name (a lambda or a local "
                f"function), so team.json could not record where it is: pass it again, "
                f"load_team(..., tools=[{name or '...'}]) or evaluate_task(..., tools=[{name or '...'}])."
            )
        if not is_importable(tool):
            return tool  # an environment method, by name
        try:
            return resolve_tool(tool, f"The team in {where} ({whose})")
        except ValueError as error:
            raise ValueError(
                f"{error} Install what it needs here, or pass the function again: load_team(..., tools=[...]) or "
                "evaluate_task(..., tools=[...])."
            ) from None

    trainer_tools = [rebuild(tool, "every agent (the trainer's `tools=`)") for tool in spec.get("tools", [])]
    agent_tools = [
        None if agent.get("tools") is None else [rebuild(tool, f"agent '{agent['name']}'") for tool in agent["tools"]]
        for agent in spec["agents"]
    ]
    unused = sorted(set(given) - used)
    if unused:
        raise ValueError(
            f"`tools` gives {unused}, but the team in {where} trained with no tool of that name (the trainer's: "
            f"{spec.get('tools', [])}; the agents': {[agent.get('tools') for agent in spec['agents']]})."
        )
    if environment_factory is None:
        environment_factory = _saved_environment_factory(spec, where, task)
    return SavedTools(trainer_tools, agent_tools, environment_factory)


def _saved_environment_factory(spec: dict, where: str, task: Any) -> Callable | None:
    recorded = spec.get("environment_factory")
    if "environment_factory" not in spec:  # written before team.json recorded it
        factory = getattr(task, "environment_factory", None)
        if factory is not None:
            logger.warning(
                f"The team in {where} has a team.json that does not record its environment; it is given its task's "
                f"({getattr(factory, '__name__', factory)}), as evaluation gave it then. Pass `environment_factory=` "
                "to load_team / evaluate_task to choose another."
            )
        return factory
    if recorded == NO_ENVIRONMENT:
        return None
    if isinstance(recorded, dict):
        raise ValueError(
            f"The team in {where} trained with the environment factory {recorded.get('name')!r}, which has no "
            "importable name (a lambda, or a class or function defined inside a function), so team.json could not "
            "record where it is: pass it again, load_team(..., environment_factory=...) or "
            "evaluate_task(..., environment_factory=...)."
        )
    try:
        return import_by_name(recorded)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"The team in {where} names its environment factory {recorded!r}, which cannot be imported here "
            f"({error}): install what it needs, or pass it again: load_team(..., environment_factory=...) or "
            "evaluate_task(..., environment_factory=...)."
        ) from error


def saved_tool_calling(saved: SavedTools, spec: dict, tokenizer, max_model_length: int | None) -> ToolCalling:
    """A loaded team's `ToolCalling`, as its trainer's (`tool_calling.team_tool_calling`): the agents' tools, rendered
    by the base's tool template (`prepare_tool_tokenizer`; a saved team's tokenizer already holds it) and TRL's
    training template where the base's is not prefix-preserving, results appended as TRL's `_get_tool_suffix_ids`
    renders them, at most `max_tool_calling_iterations` rounds (as team.json records; unlimited when it does not)."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    factory = saved.environment_factory
    environment_type = type(factory()) if factory is not None else None  # the instance probed, as TRL's init does
    agent_names = [agent["name"] for agent in spec["agents"]]
    team = TeamTools(agent_names, saved.tools, saved.agent_tools, environment_type)
    prepare_tool_tokenizer(tokenizer, None, None)
    chat_template = None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
    chat_template_kwargs = dict(spec.get("chat_template_kwargs") or {})
    # TRL's method, on the few attributes of its trainer it reads
    renderer = SimpleNamespace(
        processing_class=tokenizer,
        _tokenizer=tokenizer,
        chat_template=chat_template,
        chat_template_kwargs=chat_template_kwargs,
        _is_vlm=False,
    )
    iterations = spec.get("max_tool_calling_iterations")
    return ToolCalling(
        team,
        tokenizer,
        tokenize_text_prompts,
        chat_template,
        chat_template_kwargs,
        functools.partial(GRPOTrainer._get_tool_suffix_ids, renderer),
        iterations if iterations is not None else sys.maxsize,
        spec["max_completion_length"],
        max_model_length,
    )
