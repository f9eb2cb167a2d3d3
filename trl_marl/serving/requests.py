"""The OpenAI requests the server takes, read and checked: `/v1/chat/completions` and `/v1/completions` bodies become
a `GenerationRequest`, or an `APIError` naming the field that is wrong or not served.

Every field of the body is either served or refused: a parameter this server does not implement (tools, response
formats, logit bias, penalties other than 0, any field it does not know) is a 400 naming it, never ignored; such a
field sent at its value that asks for nothing (`tools: []`, `response_format: {"type": "text"}`, `store: false`, ...)
is accepted. A field sent as `null` is taken as absent, as OpenAI takes it.
"""

import json
import math
from dataclasses import dataclass
from typing import Any

from .errors import APIError, invalid, short, unsupported
from .tool_requests import (
    OutputRules,
    assistant_tool_calls,
    check_tool_exchanges,
    name_tool_results,
    read_output_rules,
)

# The keys a message of each role may carry besides `role`, `content` and `name`.
MESSAGE_TOOL_KEYS = {"assistant": ("tool_calls",), "tool": ("tool_call_id",)}

MAX_CHOICES = 128  # OpenAI's own bound on `n`
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5  # `/v1/completions`' `logprobs` is a count, at most 5 in OpenAI's API
# A temperature below this samples the argmax, as vLLM rules (its `_SAMPLING_EPS`): dividing logits by less overflows.
MIN_SAMPLING_TEMPERATURE = 1e-5
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")

# The fields each endpoint serves; `user` (an end user's id, for the caller's own monitoring) changes nothing here.
COMMON_FIELDS = (
    "model", "stream", "stream_options", "temperature", "top_p", "max_tokens", "stop", "seed", "n", "logprobs",
    "presence_penalty", "frequency_penalty", "user", "logit_bias",
)  # fmt: skip
# Fields taken only at the value that asks for nothing (what clients such as langchain-openai send by default); any
# other value is refused, naming the field. `metadata` (the caller's tags) is any object and changes nothing.
NO_OP_VALUES = {
    "logit_bias": ({},),
    "store": (False,),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
}
# Fields that change nothing for these models, at any value of their type (SDK releases start sending such fields by
# default): a cache key and an end user's id for the caller's monitoring, the reasoning effort of a model that does
# not reason.
IGNORED_FIELDS = {"prompt_cache_key": str, "safety_identifier": str, "reasoning_effort": str}
CHAT_FIELDS = (
    *COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs", "metadata", "store", "service_tier",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "modalities", *IGNORED_FIELDS,
)  # fmt: skip
COMPLETION_FIELDS = (*COMMON_FIELDS, "prompt", "echo", "best_of", "suffix")


@dataclass
class GenerationRequest:
    """What a request asks for, checked.

    `prompts`: one chat conversation (a list of `{"role", "content"}` messages, with `"name"` when the request names
    the speaker; the agent's system prompt not yet added)
    for `/v1/chat/completions`, or the raw prompt strings of `/v1/completions`; each prompt gets `n` completions.
    `max_tokens` None means the server's default. `top_logprobs` None means no log-probabilities."""

    kind: str  # "chat" or "completion"
    model: str
    prompts: list
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None
    rules: OutputRules | None = None  # a chat request's tools and output format (`tool_requests.py`)


def read_chat_request(body: Any) -> GenerationRequest:
    """A `/v1/chat/completions` body, checked. Raises `APIError` (400) naming the field."""
    body = present_fields(body, CHAT_FIELDS)
    conversation = messages(body.get("messages"))
    check_tool_exchanges(conversation)
    request = read_common(body, "chat", conversation)
    max_tokens, max_completion_tokens = body.get("max_tokens"), body.get("max_completion_tokens")
    if max_tokens is not None and max_completion_tokens is not None and max_tokens != max_completion_tokens:
        raise invalid(
            "max_completion_tokens",
            f"`max_tokens` ({max_tokens}) and `max_completion_tokens` ({max_completion_tokens}) disagree; send one.",
        )
    if max_completion_tokens is not None:
        request.max_tokens = positive_int(max_completion_tokens, "max_completion_tokens")
    logprobs = boolean(body.get("logprobs", False), "logprobs")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        top_logprobs = bounded_int(top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not logprobs:
            raise invalid("top_logprobs", "`top_logprobs` needs `logprobs: true`.")
    request.top_logprobs = (top_logprobs or 0) if logprobs else None
    request.rules = read_output_rules(body)
    return request


def read_completion_request(body: Any) -> GenerationRequest:
    """A `/v1/completions` body, checked. Raises `APIError` (400) naming the field."""
    body = present_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(text, str) for text in prompts):
        raise invalid("prompt", f"`prompt` must be a string or a non-empty list of strings, got {short(prompt)}.")
    request = read_common(body, "completion", prompts)
    if boolean(body.get("echo", False), "echo"):
        raise unsupported("echo", "`echo` must be false: echoing the prompt is not supported by this server.")
    if body.get("suffix") is not None:
        raise unsupported("suffix", "`suffix` is not supported by this server.")
    best_of = body.get("best_of")
    if best_of is not None and positive_int(best_of, "best_of") != request.n:
        raise unsupported("best_of", f"`best_of` other than `n` ({request.n}) is not supported by this server.")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        request.top_logprobs = bounded_int(logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    return request


def present_fields(body: Any, served: tuple[str, ...]) -> dict:
    """The body's fields that are not null; a field not in `served` is refused (400 naming it)."""
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {short(body)}.", code="invalid_body")
    body = {name: value for name, value in body.items() if value is not None}
    for name in body:
        if name not in served:
            raise unsupported(name, f"Unsupported parameter: `{name}` is not supported by this server.")
    if "model" not in body:
        raise invalid("model", "`model` is required: the name of one of the team's agents (GET /v1/models).")
    if not isinstance(body["model"], str):
        raise invalid("model", f"`model` must be a string, got {short(body['model'])}.")
    return body


def read_common(body: dict, kind: str, prompts: list) -> GenerationRequest:
    """The fields both endpoints share."""
    for penalty in ("presence_penalty", "frequency_penalty"):
        if penalty in body and number(body[penalty], penalty) != 0:
            raise unsupported(penalty, f"`{penalty}` other than 0 is not supported by this server.")
    request = GenerationRequest(kind, body["model"], prompts)
    request.stream = boolean(body.get("stream", False), "stream")
    options = body.get("stream_options")
    if options is not None:
        if not request.stream:
            raise invalid("stream_options", "`stream_options` is only allowed with `stream: true`.")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise unsupported("stream_options", f"`stream_options` takes only `include_usage`, got {short(options)}.")
        request.include_usage = boolean(options.get("include_usage", False), "stream_options.include_usage")
    if "temperature" in body:
        request.temperature = number(body["temperature"], "temperature", 0.0, 2.0)
    if "top_p" in body:
        request.top_p = number(body["top_p"], "top_p", 0.0, 1.0)
        if request.top_p == 0:
            raise invalid("top_p", "`top_p` must be above 0 (1 keeps every token).")
    if "n" in body:
        request.n = bounded_int(body["n"], "n", 1, MAX_CHOICES)
    if "seed" in body:  # a 64-bit seed; choice `i` samples with `seed + i`
        request.seed = bounded_int(body["seed"], "seed", -(2**63), 2**63 - request.n)
    if "max_tokens" in body:
        request.max_tokens = positive_int(body["max_tokens"], "max_tokens")
    if "stop" in body:
        request.stop = stop_strings(body["stop"])
    if "user" in body and not isinstance(body["user"], str):
        raise invalid("user", f"`user` must be a string, got {short(body['user'])}.")
    check_no_op_fields(body)
    return request


def check_no_op_fields(body: dict) -> None:
    """Refuse (400 naming the field) a no-op field (`NO_OP_VALUES`, `metadata`, `parallel_tool_calls`) sent with a
    value that would ask for something this server does not do."""
    for name, values in NO_OP_VALUES.items():
        if name in body and not any(type(body[name]) is type(value) and body[name] == value for value in values):
            allowed = " or ".join(f"`{json_text(value)}`" for value in values)
            raise unsupported(name, f"`{name}` is only accepted as {allowed} here, got {short(body[name])}.")
    if "metadata" in body and not isinstance(body["metadata"], dict):
        raise invalid("metadata", f"`metadata` must be an object, got {short(body['metadata'])}.")
    for name, kind in IGNORED_FIELDS.items():
        if name in body and not isinstance(body[name], kind):
            raise invalid(name, f"`{name}` must be a {kind.__name__}, got {short(body[name])}.")


def json_text(value: Any) -> str:
    return json.dumps(value)


def messages(value: Any) -> list[dict]:
    """Chat messages as `{"role", "content"}` dicts with text content (a string, or a list of text parts joined), an
    assistant's `tool_calls` and a `tool` message's `tool_call_id` kept as chat templates take them
    (`tool_requests.assistant_tool_calls`, `name_tool_results`)."""
    if not isinstance(value, list) or not value:
        raise invalid("messages", f"`messages` must be a non-empty list of messages, got {short(value)}.")
    conversation = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise invalid(where, f"`{where}` must be an object with `role` and `content`, got {short(message)}.")
        message = {key: item for key, item in message.items() if item is not None}
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise invalid(
                f"{where}.role", f"`{where}.role` must be one of {', '.join(MESSAGE_ROLES)}, got {short(role)}."
            )
        allowed = {"role", "content", "name", *MESSAGE_TOOL_KEYS.get(role, ())}
        for key in message:
            if key not in allowed:
                raise unsupported(f"{where}.{key}", f"`{where}.{key}` is not supported by this server.")
        calls = assistant_tool_calls(message["tool_calls"], where) if "tool_calls" in message else None
        content = "" if calls and "content" not in message else text_content(message, where)
        turn = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            turn["tool_calls"] = calls
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise invalid(f"{where}.tool_call_id", f"`{where}.tool_call_id` must name the call it answers.")
            turn["tool_call_id"] = call_id
        if "name" in message:  # the speaker (LangGraph names its agents' messages); the chat template may use it
            if not isinstance(message["name"], str):
                raise invalid(f"{where}.name", f"`{where}.name` must be a string, got {short(message['name'])}.")
            turn["name"] = message["name"]
        conversation.append(turn)
    return name_tool_results(conversation)


def text_content(message: dict, where: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for index, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(
                    f"{where}.content[{index}]",
                    f"`{where}.content[{index}]` is a {kind!r} part; this server takes text parts only.",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(
        f"{where}.content", f"`{where}.content` must be a string or a list of text parts, got {short(content)}."
    )


def stop_strings(value: Any) -> tuple[str, ...]:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(text, str) and text for text in strings):
        raise invalid("stop", f"`stop` must be a non-empty string or a list of them, got {short(value)}.")
    if len(strings) > MAX_STOP_STRINGS:
        raise invalid("stop", f"`stop` takes at most {MAX_STOP_STRINGS} strings, got {len(strings)}.")
    return tuple(strings)


def boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise invalid(param, f"`{param}` must be true or false, got {short(value)}.")
    return value


def number(value: Any, param: str, low: float = -math.inf, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(param, f"`{param}` must be a number, got {short(value)}.")
    if not low <= value <= high:
        raise invalid(param, f"`{param}` must be between {low:g} and {high:g}, got {value}.")
    return float(value)


def integer(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(param, f"`{param}` must be an integer, got {short(value)}.")
    return value


def bounded_int(value: Any, param: str, low: int, high: int) -> int:
    value = integer(value, param)
    if not low <= value <= high:
        raise invalid(param, f"`{param}` must be between {low} and {high}, got {value}.")
    return value


def positive_int(value: Any, param: str) -> int:
    value = integer(value, param)
    if value < 1:
        raise invalid(param, f"`{param}` must be at least 1, got {value}.")
    return value
