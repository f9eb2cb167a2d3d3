"""Tools in the built-in rollouts (`tools=`, `environment_factory=`, docs/training.md "Tools"): TRL's tool loop for a
team.

TRL's `GRPOTrainer(tools=[...])` renders the tools into the prompt, parses each completion's tool calls (TRL's
`parse_response`), runs them, appends their results (TRL's `_get_tool_suffix_ids`: the chat template's rendering of
the tool messages) and lets the model go on, up to `max_tool_calling_iterations`; the results' tokens are masked out of
the loss (`tool_mask`). Here the same loop runs over the rows of every agent at once, each round of generation one
routed call (`ToolLoop.run`), and each row with its own agent's tools: the trainer's `tools=` for every agent, an
agent's own (`agents=[{"name": ..., "tools": [...]}]`), and the methods of its episode's environment
(`environment_factory=`): all of them, or those its `tools` name.

An episode's environment (`reset` as TRL calls it, with the dataset row's columns; its methods the tools; `get_reward`
a team reward source) is made by the rollout, one per episode, and shared by the episode's agents; where an episode
forks (a MAGRPO tree's joint actions, AT-GRPO's candidates), each fork acts on its own copy (`copy.deepcopy`), so that
no two see each other's changes.
"""

import asyncio
import importlib
import inspect
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

ENVIRONMENT_HOOKS = ("reset", "get_reward")


def resolve_tool(tool: Callable | str, where: str) -> Callable:
    """A tool given as a callable, or by its importable name (`"package.module:function"`). Raises ValueError naming
    `where` when the name does not import."""
    if callable(tool):
        return tool
    module_name, separator, attribute = tool.partition(":")
    if not separator:
        module_name, _, attribute = tool.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as error:
        raise ValueError(f"{where} names the tool {tool!r}, which cannot be imported: {error}.") from None
    if not callable(found):
        raise ValueError(f"{where} names the tool {tool!r}, which is not a function.")
    return found


def is_importable(name: str) -> bool:
    """Whether a tool's name is an importable one (`package.module:function`, `package.module.function`) rather than
    an environment method's."""
    return ":" in name or "." in name


def environment_methods(environment_type: type) -> list[str]:
    """The tools an environment class offers, as TRL finds them: its public functions other than `reset` and
    `get_reward`, listed on the class (listing the instance would evaluate its properties)."""
    return [
        name
        for name, _ in inspect.getmembers(environment_type, predicate=inspect.isfunction)
        if name not in ENVIRONMENT_HOOKS and not name.startswith("_")
    ]


class TeamTools:
    """Which tools each agent has.

    Args:
        agent_names: the agents, in order.
        tools: the trainer's `tools=`, every agent's.
        agent_tools: per agent, its own `tools` entry (callables, importable names, and the names of environment
            methods it keeps to; None: none of its own).
        environment_type: the class of `environment_factory()`'s environments (None without one); its methods are
            the tools of every agent without a `tools` entry; an agent with one has those it names.
    """

    def __init__(
        self,
        agent_names: Sequence[str],
        tools: Sequence[Callable] | None,
        agent_tools: Sequence[Sequence[Callable | str] | None],
        environment_type: type | None = None,
    ):
        self.agent_names = list(agent_names)
        methods = environment_methods(environment_type) if environment_type is not None else []
        self.standalone: list[list[Callable]] = []
        self.methods: list[list[str]] = []
        for index, (name, own) in enumerate(zip(self.agent_names, agent_tools)):
            where = f"`agents[{index}]['tools']` (agent '{name}')"
            own = list(own or [])
            picked = [tool for tool in own if isinstance(tool, str) and tool in methods]
            unknown = [
                tool for tool in own if isinstance(tool, str) and tool not in methods and not is_importable(tool)
            ]
            if unknown:
                environment = environment_type.__name__ if environment_type else "none given"
                raise ValueError(
                    f"{where} names {unknown}, which are neither methods of the environment ({environment}: "
                    f"{methods}) nor importable names ('package.module:function')."
                )
            importable = [tool for tool in own if tool not in picked]
            self.standalone.append([*(tools or []), *(resolve_tool(tool, where) for tool in importable)])
            # without a `tools` entry, every method of the environment; with one, those it names (`[]`: none)
            self.methods.append(methods if agent_tools[index] is None else picked)
        self.has_environment = environment_type is not None

    def uses_tools(self, agent: int) -> bool:
        return bool(self.standalone[agent] or self.methods[agent])

    def of(self, agent: int, environment: Any = None) -> list[Callable]:
        """The agent's tools in the episode of `environment` (its methods bound to it): what its prompts render and
        its calls run."""
        bound = [getattr(environment, name) for name in self.methods[agent]] if environment is not None else []
        return [*self.standalone[agent], *bound]


@dataclass
class ToolRow:
    """One agent's tool-using turn: its prompt, what it has generated (tool results included) and said.

    `conversation` is the prompt's messages, extended with the turn's assistant and tool messages as they come;
    `tool_mask[i]` is 0 where `completion_ids[i]` is a tool result's token (not the model's), 1 elsewhere."""

    agent: int
    conversation: list[dict]
    prompt_ids: list[int]
    completion_ids: list[int]
    tools: list[Callable]
    logprobs: list[float] | None = None
    tool_mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the turn's assistant and tool messages

    @property
    def answer(self) -> str:
        """What the agent said last: its last assistant message's content (the turn's text)."""
        said = [message for message in self.messages if message.get("role") == "assistant"]
        return (said[-1].get("content") or "") if said else ""


@dataclass
class ToolStats:
    """Tool calls made and failed (an unknown tool, an exception), per agent."""

    calls: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)


def run_tool_calls(
    calls: list[dict], tools: list[Callable], stats: ToolStats, agent: int = 0, async_loop=None
) -> list[dict]:
    """Run a message's tool calls with `tools` (by name), as TRL's loop runs them: a result's `str`, an unknown tool or
    an exception an `{"error": ...}` result; an `async` tool on TRL's event loop (`async_loop`). The tool messages;
    `stats` counts them for `agent`."""
    by_name = {tool.__name__: tool for tool in tools}
    messages = []
    for call in calls:
        stats.calls[agent] += 1
        name = call.get("function", call).get("name", "unknown") if isinstance(call, dict) else "unknown"
        try:
            if call.get("type") != "function":
                raise ValueError(f"Unsupported tool call type: {call.get('type')}")
            if name not in by_name:
                raise ValueError(f"Tool {name} not found.")
            result = by_name[name](**call["function"]["arguments"])
            if inspect.isawaitable(result):
                result = (
                    asyncio.run_coroutine_threadsafe(result, async_loop).result()
                    if async_loop
                    else asyncio.run(result)
                )
        except Exception as error:
            stats.failures[agent] += 1
            result = {"error": str(error)}
        messages.append({"role": "tool", "name": name, "content": result if isinstance(result, list) else str(result)})
    return messages


class ToolLoop:
    """TRL's tool loop over rows of several agents, one routed call per round of generation.

    Args:
        parse: `f(completion_ids, prompt_ids, tools)` → the assistant message (TRL's `parse_response`).
        suffix_ids: `f(tool_messages)` → the tokens the chat template renders them with (TRL's
            `_get_tool_suffix_ids`).
        generate: `f(sequences, agents)` → `(completion ids, log-probs or None)` per row: one routed call.
        max_iterations: `max_tool_calling_iterations`.
        max_completion_length: a row's completion (tool results included) stays within it.
        max_model_length: no sequence reaches it.
        async_loop: TRL's event loop for `async` tools (None: each runs in its own).
    """

    def __init__(
        self,
        parse: Callable,
        suffix_ids: Callable,
        generate: Callable,
        max_iterations: int,
        max_completion_length: int,
        max_model_length: int | None,
        async_loop=None,
    ):
        self.parse, self.suffix_ids, self.generate = parse, suffix_ids, generate
        self.max_iterations, self.max_completion_length = max_iterations, max_completion_length
        self.max_model_length, self.async_loop = max_model_length, async_loop

    def run(self, rows: list[ToolRow]) -> ToolStats:
        """Run the tool calls of every row's completion and let it go on, round after round; the rows are updated in
        place (completion ids, tool mask, log-probs, messages). The round's tool results that would take a row past
        `max_completion_length` or the model's length are dropped, and the row ends there, as TRL does."""
        stats = ToolStats()
        for row in rows:
            row.tool_mask = [1] * len(row.completion_ids)
            row.messages = [self.parse(row.completion_ids, row.prompt_ids, row.tools)]
        active = [row for row in rows if row.messages[-1].get("tool_calls")]
        iteration = 0
        while active and iteration < self.max_iterations:
            continuing, sequences = [], []
            for row in active:
                assistant = row.messages[-1]
                results = run_tool_calls(assistant["tool_calls"], row.tools, stats, row.agent, self.async_loop)
                sequence = row.prompt_ids + row.completion_ids + self.suffix_ids(results)
                too_long = len(sequence) - len(row.prompt_ids) > self.max_completion_length or (
                    self.max_model_length is not None and len(sequence) >= self.max_model_length
                )
                if too_long:  # the results are dropped: the row ends with its call
                    continue
                row.conversation += [assistant, *results]
                row.messages += results
                continuing.append(row)
                sequences.append(sequence)
            if not continuing:
                break
            more_ids, more_logprobs = self.generate(sequences, [row.agent for row in continuing])
            active = []
            for position, (row, sequence) in enumerate(zip(continuing, sequences)):
                result_length = len(sequence) - len(row.prompt_ids) - len(row.completion_ids)
                budget = self.max_completion_length - (len(sequence) - len(row.prompt_ids))
                more = list(more_ids[position])[:budget]
                row.tool_mask += [0] * result_length + [1] * len(more)
                if row.logprobs is not None and more_logprobs is not None:
                    row.logprobs += [0.0] * result_length + list(more_logprobs[position])[: len(more)]
                row.completion_ids = sequence[len(row.prompt_ids) :] + more
                if more:
                    row.messages.append(self.parse(more, sequence, row.tools))
                    if row.messages[-1].get("tool_calls"):
                        active.append(row)
            iteration += 1
        return stats


class ToolCalling:
    """What a trainer with tools needs around TRL's: the agents' tools (`TeamTools`), their prompts rendered with them,
    the loop (`ToolLoop`) and its counts for the logs.

    Args:
        team: the agents' tools.
        tokenizer: the base's tokenizer (its chat template renders the tools, as TRL's `_tokenize_prompts`).
        tokenize: `f(tokenizer, chat_template_kwargs, tools, prompts)` → `(prompt ids, ...)`: TRL's
            `_tokenize_prompts` for text prompts (`team.base_generation.tokenize_text_prompts`).
        chat_template: TRL's `chat_template` (its training template, or None for the tokenizer's own).
        chat_template_kwargs: the config's.
        suffix_ids: TRL's `_get_tool_suffix_ids`.
        max_iterations, max_completion_length, max_model_length, async_loop: as `ToolLoop`'s.
    """

    def __init__(
        self,
        team: TeamTools,
        tokenizer,
        tokenize: Callable,
        chat_template: str | None,
        chat_template_kwargs: dict,
        suffix_ids: Callable,
        max_iterations: int,
        max_completion_length: int,
        max_model_length: int | None,
        async_loop=None,
    ):
        self.team, self.tokenizer, self.tokenize = team, tokenizer, tokenize
        self.chat_template_kwargs = {
            **chat_template_kwargs,
            **({"chat_template": chat_template} if chat_template else {}),
        }
        self.suffix_ids, self.max_iterations = suffix_ids, max_iterations
        self.max_completion_length, self.max_model_length, self.async_loop = (
            max_completion_length, max_model_length, async_loop,
        )  # fmt: skip
        self.stats = ToolStats()
        self.rows = Counter()  # per agent, rows that could call tools since the last `take_metrics`

    def render(self, model_inputs: list, row_tools: list[list[Callable]]) -> list[list[int]]:
        """Each row's prompt ids, rendered with its own tools. Rows whose tools are the same functions render in one
        call: an environment's methods bound to different episodes are the same function, while two tools that
        share a name (two agents' `lookup`, a method named like another agent's tool) are not."""
        prompt_ids: list = [None] * len(model_inputs)
        by_tools: dict[tuple, list[int]] = {}
        for row, tools in enumerate(row_tools):
            by_tools.setdefault(tuple(id(getattr(tool, "__func__", tool)) for tool in tools), []).append(row)
        for rows in by_tools.values():
            tools = row_tools[rows[0]] or None  # `or None`: some templates render tool boilerplate for `[]`
            ids, _, _ = self.tokenize(
                self.tokenizer, self.chat_template_kwargs, tools, [model_inputs[row] for row in rows]
            )
            for row, row_ids in zip(rows, ids):
                prompt_ids[row] = list(row_ids)
        return prompt_ids

    def parse(self, completion_ids: list[int], prompt_ids: list[int], tools: list[Callable]) -> dict:
        from trl.chat_template_utils import parse_response

        return parse_response(self.tokenizer, list(completion_ids), prefix=list(prompt_ids), tools=tools)

    def loop(self, generate: Callable) -> ToolLoop:
        """The loop of one `generate` call, its rounds generated by `generate(sequences, agents)`."""
        return ToolLoop(
            self.parse, self.suffix_ids, generate, self.max_iterations, self.max_completion_length,
            self.max_model_length, self.async_loop,
        )  # fmt: skip

    def record(self, tool_agents: list[int], stats: ToolStats) -> None:
        """Count a call's rows with tools (their agents) and its loop's tool calls, for `take_metrics`."""
        self.rows.update(tool_agents)
        self.stats.calls.update(stats.calls)
        self.stats.failures.update(stats.failures)

    def take_metrics(self, agent_names: Sequence[str]) -> dict[str, float]:
        """TRL's tool metrics since the last call, over the team (`tools/call_frequency`: calls per row with tools,
        `tools/failure_frequency`: failed calls per call) and per agent (`agents/<name>/tool_calls`,
        `agents/<name>/tool_failures`); the counts start again."""
        rows, calls, failures = (
            sum(self.rows.values()),
            sum(self.stats.calls.values()),
            sum(self.stats.failures.values()),
        )
        metrics = {}
        if rows:
            metrics["tools/call_frequency"] = calls / rows
            metrics["tools/failure_frequency"] = failures / calls if calls else 0.0
            for agent, count in self.rows.items():
                name = agent_names[agent]
                metrics[f"agents/{name}/tool_calls"] = self.stats.calls[agent] / count
                metrics[f"agents/{name}/tool_failures"] = self.stats.failures[agent] / count
        self.stats, self.rows = ToolStats(), Counter()
        return metrics


def tool_call_json(call: dict) -> str:
    """A parsed tool call as text (logs, tests)."""
    function = call.get("function", call)
    return json.dumps({"name": function.get("name"), "arguments": function.get("arguments")})


def check_tool_settings(args: Any, environment_factory: Any, num_bases: int, episode: Any) -> None:
    """What tools in the built-in rollouts cannot do yet, refused by name before TRL's init."""
    if isinstance(environment_factory, dict):
        raise ValueError(
            "`environment_factory` as a dict of several environments (TRL's multi-environment mode) is not supported "
            "by the team trainers: give one factory; its episodes may differ by the row's columns `reset` reads."
        )
    if num_bases > 1:
        raise ValueError(
            "Tools (`tools=`, `environment_factory=`, an agent's `tools`) are not supported on a team of several "
            "base models yet: put the agents that call tools on the trainer's model."
        )
    if episode is not None:
        raise ValueError(
            "`tools=` and `environment_factory=` drive the built-in rollouts: an agent program (`episode=`) runs its "
            "own tools, offering them to the agents in its requests (docs/programs.md, 'Tools')."
        )
    if environment_factory is not None and getattr(args, "joint_mode", "aligned") == "cross":
        raise ValueError(
            "`joint_mode='cross'` recombines completions sampled in different episodes, which an environment "
            "(`environment_factory=`) cannot follow. Use `joint_mode='aligned'`."
        )


def prepare_tool_tokenizer(processing_class, model, args):
    """The trainer's tokenizer (loaded as TRL loads it when not given), made to render tools and read calls back: a
    base whose chat template cannot render a tool exchange but speaks ChatML gets `CHATML_TOOLS_TEMPLATE`
    (`tool_templates`) and TRL's Qwen response template, before TRL's init looks for them."""
    from transformers import AutoProcessor
    from trl.trainer.utils import get_config_model_id

    from .tool_templates import prepare_response_parsing, tool_chat_template, tool_template_name

    if processing_class is None:
        processing_class = AutoProcessor.from_pretrained(
            get_config_model_id(model.config),
            revision=args.model_init_kwargs.get("revision") if args.model_init_kwargs else None,
            truncation_side="left",
            padding_side="left",
            trust_remote_code=args.trust_remote_code,
        )
    name = tool_template_name(processing_class)
    if name is not None:
        processing_class.chat_template = tool_chat_template(processing_class, name)
    prepare_response_parsing(processing_class, name)
    return processing_class


def episode_environments(factory: Callable) -> Callable[[dict], tuple[Any, Any]]:
    """The rollouts' `environment` setting: `f(example)` → a new environment of `factory`, reset with the row's
    columns as TRL resets it (`reset(**row)`), and what `reset` returned."""

    def environment(example: dict) -> tuple[Any, Any]:
        instance = factory()
        return instance, instance.reset(**example)

    return environment


def team_tool_calling(
    trainer, args, tools, environment_factory, tokenize: Callable, max_model_length: int | None
) -> ToolCalling:
    """The trainer's `ToolCalling`: the agents' tools (the trainer's `tools=`, each agent's own, the environment's
    methods), rendered and parsed with TRL's template and helpers, run by TRL's loop settings."""
    environment_type = None
    if environment_factory is not None:
        environment_type = type(trainer._environment_pool[None][0])  # the instance TRL's init probed
    team = TeamTools(
        args.agent_names, list(tools or []), [agent.get("tools") for agent in args.agents], environment_type
    )
    return ToolCalling(
        team,
        trainer.processing_class,
        tokenize,
        trainer.chat_template,
        trainer.chat_template_kwargs,
        trainer._get_tool_suffix_ids,
        trainer.max_tool_calling_iterations,
        trainer.max_completion_length,
        max_model_length,
        getattr(trainer, "async_loop", None),
    )
