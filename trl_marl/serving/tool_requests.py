"""What a chat request asks of tools and structured output, checked: `tools`, `tool_choice`, `parallel_tool_calls` and
`response_format` become an `OutputRules`, and the tool exchanges of its messages (an assistant's `tool_calls`, `tool`
messages) what chat templates render. Every error is an `APIError` naming the field.

What each asks for (docs/serving.md, "Tools and structured output"):

- `tools` are rendered into the prompt by the agent's chat template (`trl_marl.generation.tool_templates`); with
  `tool_choice` "auto" (the default when tools are given) the answer is parsed back into `tool_calls`, the model free
  to answer in text; "none" renders them and parses nothing.
- "required" and a named function (`{"type": "function", "function": {"name": ...}}`) are enforced while sampling: a
  grammar (`grammars.py`) lets the model write only tool calls (of that function), each call's arguments valid against
  its `parameters`; one call, or several with `parallel_tool_calls` (the default).
- `response_format` `{"type": "json_object"}` and `{"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}` are enforced the same way: the content is a JSON object (valid against the schema). With tools on
  "auto", the answer is either tool calls or that JSON.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import invalid, short, unsupported

TOOL_CHOICES = ("none", "auto", "required")
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name


@dataclass(frozen=True)
class OutputRules:
    """The tools a chat request offers and what its answer must be.

    Args:
        tools: the function tools, as the request gave them (`{"type": "function", "function": {...}}`).
        tool_choice: "none", "auto", "required", or "function" (the one named by `function`).
        function: the function `tool_choice` names.
        parallel_tool_calls: whether an answer may hold several tool calls.
        response_format: None (text), `{"type": "json_object"}`, or `{"type": "json_schema", "name", "schema",
            "strict"}`.
    """

    tools: tuple[dict, ...] = ()
    tool_choice: str = "none"
    function: str | None = None
    parallel_tool_calls: bool = True
    response_format: dict | None = None

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the answer is read back into tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the sampling (`grammars.py`)."""
        return self.tool_choice in ("required", "function") or self.response_format is not None

    def offered_tools(self) -> list[dict]:
        """The tools a grammar may call: the named one, or all."""
        if self.tool_choice == "function":
            return [tool for tool in self.tools if tool["function"]["name"] == self.function]
        return list(self.tools)


def read_output_rules(body: dict) -> OutputRules | None:
    """The body's tool and output fields (absent or null ones taken as OpenAI takes them), or None when they ask for
    nothing (no tools, a text answer)."""
    tools = read_tools(body.get("tools", []))
    choice = body.get("tool_choice", "auto" if tools else "none")
    tool_choice, function = read_tool_choice(choice, tools)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", f"`parallel_tool_calls` must be true or false, got {short(parallel)}.")
    response_format = read_response_format(body.get("response_format", {"type": "text"}))
    if not tools and response_format is None:
        return None
    return OutputRules(tuple(tools), tool_choice, function, parallel, response_format)


def read_tools(value: Any) -> list[dict]:
    """`tools`: function tools with distinct names, `parameters` a JSON schema object."""
    if not isinstance(value, list):
        raise invalid("tools", f"`tools` must be a list of tools, got {short(value)}.")
    names = set()
    for index, tool in enumerate(value):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise unsupported(f"{where}.type", f"`{where}.type` is {kind!r}; this server serves function tools.")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise invalid(f"{where}.function", f"`{where}.function` must be an object, got {short(function)}.")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.match(name):
            raise invalid(
                f"{where}.function.name",
                f"`{where}.function.name` must be 1 to 64 letters, digits, `_` or `-`, got {short(name)}.",
            )
        if name in names:
            raise invalid(f"{where}.function.name", f"Two tools are named `{name}`: give each its own name.")
        names.add(name)
        for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise invalid(
                    f"{where}.function.{key}",
                    f"`{where}.function.{key}` must be a {kind.__name__}, got {short(function[key])}.",
                )
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            field = f"{where}.function.{sorted(unknown)[0]}"
            raise unsupported(field, f"`{field}` is not supported by this server.")
    return [
        {"type": "function", "function": {key: item for key, item in tool["function"].items() if item is not None}}
        for tool in value
    ]


def read_tool_choice(value: Any, tools: list[dict]) -> tuple[str, str | None]:
    """`tool_choice`: a mode, or `{"type": "function", "function": {"name"}}` naming one of `tools`."""
    if isinstance(value, str):
        if value not in TOOL_CHOICES:
            raise invalid("tool_choice", f"`tool_choice` must be one of {', '.join(TOOL_CHOICES)}, got {value!r}.")
        if value == "required" and not tools:
            raise invalid("tool_choice", "`tool_choice` is required, which needs `tools` to call.")
        return value, None
    name = value.get("function", {}).get("name") if isinstance(value, dict) else None
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(name, str):
        raise invalid(
            "tool_choice",
            f'`tool_choice` must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}},'
            f" got {short(value)}.",
        )
    if name not in {tool["function"]["name"] for tool in tools}:
        raise invalid("tool_choice", f"`tool_choice` names `{name}`, which is not one of the request's `tools`.")
    return "function", name


def read_response_format(value: Any) -> dict | None:
    """`response_format`: None for text, else `{"type": "json_object"}` or `{"type": "json_schema", "name",
    "schema", "strict"}`."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise invalid(
                "response_format.json_schema",
                f"`response_format.json_schema` must be an object with a `name` and a `schema`, got {short(spec)}.",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise invalid("response_format.json_schema.schema", f"The schema must be an object, got {short(schema)}.")
        return {"type": "json_schema", "name": spec["name"], "schema": schema, "strict": bool(spec.get("strict"))}
    raise invalid(
        "response_format",
        f'`response_format` must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": "json_schema", ...}}, '
        f"got {short(value)}.",
    )


def assistant_tool_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` (OpenAI's: `id`, `type`, `function` with `arguments` a JSON string) as chat
    templates take them: `arguments` a dict."""
    if not isinstance(value, list):
        raise invalid(f"{where}.tool_calls", f"`{where}.tool_calls` must be a list, got {short(value)}.")
    calls = []
    for index, call in enumerate(value):
        at = f"{where}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid(at, f"`{at}` must be a function call with a `name`, got {short(call)}.")
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                raise invalid(f"{at}.function.arguments", f"`{at}.function.arguments` is not JSON.") from None
        if not isinstance(arguments, dict):
            raise invalid(f"{at}.function.arguments", f"`{at}.function.arguments` must be a JSON object.")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{at}.id", f"`{at}.id` must be a string: the id that the call's tool message answers.")
        if any(earlier["id"] == call_id for earlier in calls):
            raise invalid(f"{at}.id", f"`{at}.id` is `{call_id}`, the id of another call of the same message.")
        calls.append(
            {"type": "function", "function": {"name": function["name"], "arguments": arguments}, "id": call_id}
        )
    return calls


def check_tool_exchanges(conversation: list[dict], where: Callable[[int, int | None], str] | None = None) -> None:
    """Refuse (400 naming the message) a history whose tool results and calls cannot be right, as OpenAI refuses it:
    a `tool` message answers one of the calls of the assistant message it follows (the `tool` messages between them
    answering its other calls), each call once, and every call is answered before the next message of another role.
    `where(message, call)` names message `message` (its call `call`, when not None) in the error; by default
    `messages[i]` and `messages[i].tool_calls[j]`."""
    if where is None:

        def where(message: int, call: int | None) -> str:
            return f"messages[{message}]" + ("" if call is None else f".tool_calls[{call}]")

    asking, waiting, answered = None, [], set()  # the assistant message being answered, its calls not yet answered
    for index, message in enumerate([*conversation, {"role": "end"}]):  # at the end, no call may still wait
        if message["role"] == "tool":
            name, call_id = where(index, None), message["tool_call_id"]
            if asking is None:
                raise invalid(
                    name,
                    f"`{name}` is a tool result with no tool call before it to answer: a tool result comes right "
                    "after the assistant message whose call it answers.",
                )
            if call_id in answered:
                raise invalid(name, f"`{name}` answers the tool call `{call_id}` again: each call has one result.")
            if call_id not in waiting:
                calls = ", ".join(f"`{call['id']}`" for call in conversation[asking]["tool_calls"])
                raise invalid(
                    name,
                    f"`{name}` answers the tool call `{call_id}`, which is none of the calls it follows ({calls}): "
                    "give the id of the call it answers.",
                )
            waiting.remove(call_id)
            answered.add(call_id)
            continue
        if waiting:
            call_ids = [call["id"] for call in conversation[asking]["tool_calls"]]
            name = where(asking, call_ids.index(waiting[0]))
            raise invalid(
                name,
                f"`{name}` (`{waiting[0]}`) is a tool call that no tool result answers: each call of an assistant "
                "message is answered by a tool message right after it, before the next message.",
            )
        asking, answered = None, set()
        if message.get("tool_calls"):
            asking, waiting = index, [call["id"] for call in message["tool_calls"]]


def name_tool_results(conversation: list[dict]) -> list[dict]:
    """Give each `tool` message the `name` of the call it answers (found by its `tool_call_id`): templates that
    render a result with its function's name read it there."""
    names = {}
    for message in conversation:
        for call in message.get("tool_calls", ()):
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and "name" not in message and message.get("tool_call_id") in names:
            message["name"] = names[message["tool_call_id"]]
    return conversation
