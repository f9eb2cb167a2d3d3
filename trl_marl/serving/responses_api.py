"""OpenAI's Responses API (`POST /v1/responses`), the subset agent frameworks use, served by the chat path.

The OpenAI Agents SDK calls a model through the Responses API by default. A request's `instructions` and `input`
(a string, or items: messages with text parts, `function_call` items the model made, `function_call_output` items
with the program's tool results) become a chat conversation; its `tools` (`{"type": "function", "name", "parameters",
...}`), `tool_choice`, `parallel_tool_calls` and `text.format` (text, `json_object`, `json_schema`) become the chat
request's output rules (`tool_requests.OutputRules`); `max_output_tokens`, `temperature` and `top_p` its sampling. The
answer comes back as output items: a `message` with one `output_text` part (the content), and a `function_call` item
per tool call (`call_id`, `name`, `arguments`); with `stream: true`, as the Responses API's events
(`response.created` ... `response.output_text.delta` ... `response.function_call_arguments.done` ...
`response.completed`).

What is not served is refused by name (400): `previous_response_id` and `conversation` (the server keeps no
responses: send the whole input, as the Agents SDK does by default), `store: true`, tools other than functions,
`background`, and input items other than messages, function calls and their outputs. Fields that change nothing here
(`metadata`, `user`, `prompt_cache_key`, `safety_identifier`, `reasoning` on a model that does not reason, `truncation`
"disabled", an empty `include`) are accepted.
"""

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError, invalid, short, unsupported
from .requests import GenerationRequest, number, positive_int
from .tool_requests import check_tool_exchanges, read_output_rules

RESPONSES_FIELDS = (
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "temperature", "top_p",
    "max_output_tokens", "stream", "text", "store", "include", "metadata", "user", "prompt_cache_key",
    "safety_identifier", "reasoning", "truncation", "service_tier", "previous_response_id", "conversation",
    "background", "stream_options",
)  # fmt: skip
REFUSED = {
    "previous_response_id": "this server keeps no responses: send the whole conversation as `input`",
    "conversation": "this server keeps no conversations: send the whole conversation as `input`",
    "background": "responses are answered as they are generated, never in the background",
}
INCLUDABLE = ()  # `include` is accepted empty


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class ResponsesRequest:
    """A Responses request: the chat request it is answered by, and what its response object echoes."""

    chat: GenerationRequest
    echo: dict = field(default_factory=dict)  # the request's settings as the response object repeats them


def read_responses_request(body: Any) -> ResponsesRequest:
    """A `/v1/responses` body, checked, as a chat request. Raises `APIError` (400) naming the field."""
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {short(body)}.", code="invalid_body")
    body = {name: value for name, value in body.items() if value is not None}
    for name in body:
        if name not in RESPONSES_FIELDS:
            raise unsupported(name, f"Unsupported parameter: `{name}` is not supported by this server.")
        if name in REFUSED and body[name] is not False:
            raise unsupported(name, f"`{name}` is not supported: {REFUSED[name]}.")
    if not isinstance(body.get("model"), str):
        raise invalid("model", "`model` is required: the name of one of the team's agents (GET /v1/models).")
    if body.get("store") is True:
        raise unsupported("store", "`store: true` is not supported: this server keeps no responses.")
    if body.get("include") not in (None, []):
        raise unsupported("include", f"`include` is only accepted empty here, got {short(body['include'])}.")
    if body.get("truncation", "disabled") != "disabled":
        raise unsupported("truncation", "Only `truncation: disabled` is served: a prompt past the context is a 400.")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_obfuscation"}):
        raise unsupported(
            "stream_options", f"`stream_options` takes only `include_obfuscation`, got {short(options)}."
        )
    chat = GenerationRequest("chat", body["model"], conversation(body.get("input"), body.get("instructions")))
    chat.stream = body.get("stream", False) is True
    if "temperature" in body:
        chat.temperature = number(body["temperature"], "temperature", 0.0, 2.0)
    if "top_p" in body:
        chat.top_p = number(body["top_p"], "top_p", 0.0, 1.0)
        if chat.top_p == 0:
            raise invalid("top_p", "`top_p` must be above 0 (1 keeps every token).")
    if "max_output_tokens" in body:
        chat.max_tokens = positive_int(body["max_output_tokens"], "max_output_tokens")
    chat_fields = {
        "tools": [chat_tool(tool, index) for index, tool in enumerate(body.get("tools", []))],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "response_format": chat_response_format(body.get("text")),
    }
    if "tool_choice" in body:
        chat_fields["tool_choice"] = chat_tool_choice(body["tool_choice"])
    chat.rules = read_output_rules(chat_fields)
    echo = {
        "instructions": body.get("instructions"),
        "max_output_tokens": chat.max_tokens,
        "metadata": body.get("metadata", {}),
        "parallel_tool_calls": chat_fields["parallel_tool_calls"],
        "temperature": chat.temperature,
        "top_p": chat.top_p,
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools", []),
        "text": body.get("text", {"format": {"type": "text"}}),
    }
    return ResponsesRequest(chat, echo)


def chat_tool(tool: Any, index: int) -> dict:
    """A Responses function tool (`{"type": "function", "name", "description", "parameters", "strict"}`) as a chat
    tool."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise unsupported(f"{where}.type", f"`{where}.type` is {kind!r}; this server serves function tools.")
    unknown = set(tool) - {"type", "name", "description", "parameters", "strict"}
    if unknown:
        raise unsupported(f"{where}.{sorted(unknown)[0]}", f"`{where}.{sorted(unknown)[0]}` is not supported.")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(value: Any) -> Any:
    """A Responses `tool_choice` (a mode, or `{"type": "function", "name"}`) as a chat one."""
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def chat_response_format(text: Any) -> dict:
    """`text.format` (`{"type": "text" | "json_object" | "json_schema", "name", "schema", "strict"}`) as a chat
    `response_format`."""
    if text is None:
        return {"type": "text"}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise unsupported("text", f"`text` takes `format` (and `verbosity`), got {short(text)}.")
    if text.get("verbosity", "medium") != "medium":
        raise unsupported("text.verbosity", "`text.verbosity` other than medium is not supported by this server.")
    fmt = text.get("format", {"type": "text"})
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if isinstance(fmt, dict) and fmt.get("type") in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise invalid("text.format", f"`text.format` must be text, json_object or json_schema, got {short(fmt)}.")


def conversation(value: Any, instructions: Any) -> list[dict]:
    """`instructions` and `input` as chat messages (`tool_calls` and `tool` messages as `requests.messages` makes
    them), each `function_call` item joined to the assistant message it follows, and an assistant `message` item
    between a turn's calls and their outputs joined to that turn (its text after the turn's, a blank line between).
    A history whose calls and results do not match is refused naming the input item
    (`tool_requests.check_tool_exchanges`)."""
    from .requests import messages

    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions", f"`instructions` must be a string, got {short(instructions)}.")
    items = [{"role": "user", "content": value}] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise invalid("input", f"`input` must be a string or a non-empty list of items, got {short(value)}.")
    chat: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    origins = ["instructions"] if instructions else []  # the input item each chat message comes from
    call_origins = {}  # (chat message, call) -> the `function_call` item it comes from
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise invalid(where, f"`{where}` must be an object, got {short(item)}.")
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = [text_part(part, f"{where}.content[{position}]") for position, part in enumerate(content)]
            calling = chat[-1] if chat and chat[-1]["role"] == "assistant" and chat[-1].get("tool_calls") else None
            texts = (content, calling["content"]) if calling is not None else ()
            if (
                item.get("role") == "assistant"
                and texts
                and all(isinstance(text, str | list | None) for text in texts)
            ):
                calling["content"] = joined_text(calling["content"], content)  # said between the calls and results
                continue
            chat.append({"role": item.get("role"), "content": content})
            origins.append(where)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "{}")}
            previous = chat[-1] if chat else None
            if previous is not None and previous["role"] == "assistant":
                previous["tool_calls"] = [*(previous.get("tool_calls") or []), call]
            else:
                chat.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(where)
            call_origins[len(chat) - 1, len(chat[-1]["tool_calls"]) - 1] = where
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(text_part(part, f"{where}.output")["text"] for part in output)
            chat.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
            origins.append(where)
        else:
            raise unsupported(f"{where}.type", f"`{where}` is a {kind!r} item; this server takes messages, "
                              "function calls and their outputs.")  # fmt: skip
    try:
        turns = messages(chat)
    except APIError as error:  # named by its chat message, whose place differs from the input item's
        raise invalid("input", f"An input item cannot be served ({error.param}): {error.message}") from None
    check_tool_exchanges(
        turns, lambda message, call: origins[message] if call is None else call_origins[message, call]
    )
    return turns


def joined_text(content: str | list | None, more: str | list) -> str | list:
    """An assistant turn's content (a string, text parts, or None) with the text of a later message of the same turn
    after it, a blank line between."""
    if not content or not more:
        return content or more

    def parts(text: str | list) -> list:
        return [{"type": "text", "text": text}] if isinstance(text, str) else text

    return [*parts(content), {"type": "text", "text": "\n\n"}, *parts(more)]


def text_part(part: Any, where: str) -> dict:
    """An `input_text` / `output_text` part as a chat text part."""
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
        return {"type": "text", "text": part.get("text")}
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise unsupported(where, f"`{where}` is a {kind!r} part; this server takes text parts only.")


def output_items(content: str | None, tool_calls: list[dict]) -> list[dict]:
    """A response's output items: the message (when there is content, or no call), then one item per call."""
    items = []
    if content or not tool_calls:
        items.append(message_item(new_id("msg"), content or "", "completed"))
    for call in tool_calls:
        items.append(function_call_item(call, "completed"))
    return items


def message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def function_call_item(call: dict, status: str, arguments: str | None = None) -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if arguments is None else arguments,
        "status": status,
    }


def response_object(
    response_id: str,
    created: int,
    model: str,
    echo: dict,
    status: str,
    output: list[dict],
    usage: dict | None = None,
    incomplete: str | None = None,
) -> dict:
    """A `response` object (`usage` in the Responses API's form: input and output tokens)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "usage": None if usage is None else responses_usage(usage),
        **echo,
    }


def responses_usage(usage: dict) -> dict:
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


class ResponseEvents:
    """The Responses API's stream events of one answer, from the chat path's deltas (content text, tool-call deltas
    in the chat format, the end): each a server-sent event `event: <type>` with its JSON `data`.

    Its output items are the unstreamed response's (`output_items`): one message holding all the content, then a
    `function_call` item per call. The message's text is sent as it is written; since text may still follow a call
    (and belongs to the message before it), the calls are held and sent once the answer ends, after the message."""

    def __init__(self, model: str, echo: dict):
        self.response_id, self.created = new_id("resp"), int(time.time())
        self.model, self.echo = model, echo
        self.sequence = 0
        self.output: list[dict] = []  # the items done so far
        self.message: dict | None = None  # the message item being written
        self.text = ""
        self.calls: dict[int, dict] = {}  # chat tool-call index -> the call, held until the answer ends

    def event(self, kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

    def response(self, status: str, usage: dict | None = None, incomplete: str | None = None) -> dict:
        return response_object(
            self.response_id, self.created, self.model, self.echo, status, list(self.output), usage, incomplete
        )

    def start(self) -> list[str]:
        created = self.response("in_progress")
        return [self.event("response.created", response=created), self.event("response.in_progress", response=created)]

    def content(self, text: str) -> list[str]:
        events = []
        if self.message is None:
            self.message = message_item(new_id("msg"), "", "in_progress")
            self.message["content"] = []
            index = len(self.output)
            events.append(self.event("response.output_item.added", output_index=index, item=self.message))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self.event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                     content_index=0, part=part))  # fmt: skip
        self.text += text
        events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=len(self.output), content_index=0, delta=text, logprobs=[]))  # fmt: skip
        return events

    def _close_message(self) -> list[str]:
        if self.message is None:
            return []
        index, item_id = len(self.output), self.message["id"]
        part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
        done = message_item(item_id, self.text, "completed")
        events = [
            self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                       text=self.text, logprobs=[]),
            self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=index, item=done),
        ]  # fmt: skip
        self.output.append(done)
        self.message, self.text = None, ""
        return events

    def tool_call(self, delta: dict) -> list[str]:
        """A chat tool-call delta (its first: index, id, name; then its arguments), held until the answer ends."""
        index = delta["index"]
        if index not in self.calls:
            self.calls[index] = {"id": delta["id"], "function": {"name": delta["function"]["name"], "arguments": ""}}
        self.calls[index]["function"]["arguments"] += delta.get("function", {}).get("arguments", "")
        return []

    def _call_items(self) -> list[str]:
        """Each held call's events: its item added, its arguments (whole), its item done."""
        events = []
        for index in sorted(self.calls):
            call, output_index = self.calls[index], len(self.output)
            item_id, arguments = "fc_" + call["id"].removeprefix("call_"), call["function"]["arguments"]
            item = function_call_item(call, "in_progress", arguments="")
            done = function_call_item(call, "completed")
            events += [
                self.event("response.output_item.added", output_index=output_index, item=item),
                self.event("response.function_call_arguments.delta", item_id=item_id, output_index=output_index,
                           delta=arguments),
                self.event("response.function_call_arguments.done", item_id=item_id, output_index=output_index,
                           arguments=arguments, name=call["function"]["name"]),
                self.event("response.output_item.done", output_index=output_index, item=done),
            ]  # fmt: skip
            self.output.append(done)
        self.calls = {}
        return events

    def finish(self, usage: dict, finish_reason: str) -> list[str]:
        events = self._close_message() + self._call_items()
        if not self.output:  # an empty answer is still a message
            events += self.content("") + self._close_message()
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        response = self.response("incomplete" if incomplete else "completed", usage, incomplete)
        kind = "response.incomplete" if incomplete else "response.completed"
        return events + [self.event(kind, response=response)]

    def failure(self, error: APIError) -> list[str]:
        response = {
            **self.response("failed"),
            "error": {"code": error.code or "server_error", "message": error.message},
        }
        return [self.event("response.failed", response=response)]
