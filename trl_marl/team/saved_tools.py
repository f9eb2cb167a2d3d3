"""The tools and the environment a team trained with: recorded in `team.json`, and rebuilt for `load_team` (`Team.run`,
`Team.play`) and `evaluate_task`, so that a saved team is played and evaluated with exactly what it trained with.

`team.json` records (`tools_record`, beside the agents' entries):

- `tools`: the trainer's `tools=` (every agent's), each by its importable name (`"package.module:function"`);
- `environment_factory`: the factory of the episodes' environment (the trainer's `environment_factory=`, or its task's)
  by importable name, or `"none"` when the team trained without an environment, even on a task that has one;
- each agent's own `tools` entry as it was given: functions by importable name, the environment's methods by their
  names (`[]`: none; no entry: all of the environment's).

Names are rebuilt with `importable.import_by_name`, which reads what `importable_name` writes: `"module:function"`, a
dotted attribute (`"module:Class.method"`), a script's path (`"/path/train.py:function"`, for a script run as
`python train.py`: the script runs again as a module, its `if __name__ == "__main__":` block left out), a module that
moved, and TRL's `"package.module.function"`. A function or class without an importable name (a lambda, a function or
class defined inside a function, one typed into an interactive session) is recorded as `{"name": <its __name__>,
"importable": false}`. Rebuilding one of those, or a name that does not import here, is an `UnrebuiltTool` error naming
it (and its agent) that says to pass it again (`tools=[...]`, `environment_factory=` of `load_team` and
`evaluate_task`). A function given again stands in only for such recorded tools of its `__name__`, never for one that
imports here.

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
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..generation.tool_calling import TeamTools, ToolCalling, is_importable, prepare_tool_tokenizer
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


class UnrebuiltTool(ValueError):
    """A tool or environment factory a saved team trained with that cannot be rebuilt here.

    Attributes:
        problem: what it is and why it cannot be rebuilt ("The team in ... trained agent 'a' with the tool 'f', ...").
        keyword, value: what to pass again (`tools`, `[f]`; `environment_factory`, `MyEnvironment`).
        remedy: what else would rebuild it here ("install what it needs here"), or None.
    """

    def __init__(self, problem: str, keyword: str, value: str, remedy: str | None = None):
        self.problem, self.keyword, self.value, self.remedy = problem, keyword, value, remedy
        passed = f"{keyword}={value}"
        super().__init__(self.telling(f"pass it again: load_team(..., {passed}) or evaluate_task(..., {passed})"))

    def telling(self, passing: str) -> str:
        """The message, `passing` saying how to pass it again where the error is shown."""
        return f"{self.problem}: {self.remedy + ', or ' if self.remedy else ''}{passing}."


def _imported(name: str, problem: str, keyword: str, value: str) -> Callable:
    """What team.json names `name` (`import_by_name`), imported here. Raises `UnrebuiltTool` (`problem` says what it
    is) when it does not import: any error its module raises, since importing runs the module's (or script's) code,
    a script's `sys.exit` at its top level included."""
    try:
        found = import_by_name(name)
        if not callable(found):
            raise TypeError(f"{name} is a {type(found).__name__}, not a function or class")
    except (Exception, SystemExit) as error:
        script = name.rpartition(":")[0]
        if not script.endswith(".py"):
            remedy = "install what it needs here"
        else:
            remedy = "fix the script" if Path(script).is_file() else "put the script back at that path"
        reason = f"{type(error).__name__}: {error}"
        raise UnrebuiltTool(f"{problem}, which cannot be imported here ({reason})", keyword, value, remedy) from error
    return found


def short_name(name: str) -> str:
    """A recorded tool's `__name__`: the last part of its importable name (`"pkg.tools:Search.run"` → `"run"`)."""
    return name.rpartition(":")[2].rpartition(".")[2]


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
        tools: functions given again, each standing in for the recorded tools of its `__name__` (in the trainer's
            `tools` and in every agent's) that cannot be rebuilt here: those team.json could not name by import path,
            and those whose name does not import here. A recorded tool that imports is never replaced.
        environment_factory: given again, it stands in for the recorded one.

    Raises:
        UnrebuiltTool (a ValueError): a recorded tool or factory has no importable name, or its name does not import
            here, and is not given again. The message names the agent and the tool.
        ValueError: a given tool stands in for none of the recorded ones.
    """
    given = {tool.__name__: tool for tool in tools or []}
    used, importing = set(), {}  # stand-ins used; the recorded names that imported, by `__name__`

    def rebuild(tool, whose: str) -> Callable | str:
        if isinstance(tool, str) and not is_importable(tool):
            return tool  # an environment method, by name
        if not isinstance(tool, str):  # recorded without an importable name
            name = (tool or {}).get("name")
            if name in given:
                used.add(name)
                return given[name]
            shown = f"the tool {name!r}" if name else "a tool"
            raise UnrebuiltTool(
                f"The team in {where} trained {whose} with {shown}, which has no importable name (a lambda or a local "
                "function), so team.json could not record where it is",
                "tools",
                f"[{name or '...'}]",
            )
        short, problem = short_name(tool), f"The team in {where} trained {whose} with the tool {tool!r}"
        try:
            found = _imported(tool, problem, "tools", f"[{short}]")
        except UnrebuiltTool:
            if short not in given:
                raise
            used.add(short)
            return given[short]
        importing.setdefault(short, []).append(tool)
        return found

    trainer_tools = [rebuild(tool, "every agent (the trainer's `tools=`)") for tool in spec.get("tools", [])]
    agent_tools = [
        None if agent.get("tools") is None else [rebuild(tool, f"agent '{agent['name']}'") for tool in agent["tools"]]
        for agent in spec["agents"]
    ]
    unused = sorted(set(given) - used)
    if unused:
        kept = sorted({name for short in unused for name in importing.get(short, [])})
        recorded = (
            f"{kept} import here and are kept"
            if kept
            else f"it trained with {spec.get('tools', [])} (the trainer's) and "
            f"{[agent.get('tools') for agent in spec['agents']]} (the agents')"
        )
        raise ValueError(
            f"`tools` gives {unused}, but a function given again stands in only for a recorded tool of its name that "
            f"cannot be rebuilt here (no importable name, or a name that does not import), and the team in {where} "
            f"has none of that name: {recorded}."
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
        raise UnrebuiltTool(
            f"The team in {where} trained with the environment factory {recorded.get('name')!r}, which has no "
            "importable name (a lambda, or a class or function defined inside a function), so team.json could not "
            "record where it is",
            "environment_factory",
            recorded.get("name") or "...",
        )
    problem = f"The team in {where} trained with the environment factory {recorded!r}"
    return _imported(recorded, problem, "environment_factory", short_name(recorded))


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
