"""An answer read back as OpenAI's assistant message: its content and its `tool_calls`, whole or as stream deltas.

The answer's tokens are parsed by the base's response template (transformers' `parse_response`, through TRL's
`parse_response`, which falls back to the plain text when a call is malformed: `trl_marl.generation.tool_templates`).
A call becomes `{"id": "call_...", "type": "function", "function": {"name", "arguments": <JSON text>}}`, the message's
`content` is the text around the calls (None when there is none, as OpenAI gives it), and the choice's
`finish_reason` is "tool_calls" when the answer ended after calling tools.

A stream sends the content as it is written, holding back what could be the opening of a tool call (the response
template's marker, `<tool_call>` for Hermes-style templates); each call goes out once it is complete (its closing
marker written and the answer so far parsing with it): a first delta with its index, id, type and name, then its
arguments. A template whose marker is unknown holds the content back until the answer ends.
"""

import json
import secrets

from ..generation.tool_templates import parse_tool_calls
from .tool_requests import OutputRules


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def openai_tool_calls(parsed: dict) -> list[dict]:
    """The parsed message's tool calls in OpenAI's format, each with a new id and its arguments as JSON text."""
    calls = []
    for call in parsed.get("tool_calls") or ():
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": call_id(), "type": "function", "function": {"name": function["name"], "arguments": text}})
    return calls


class AnswerReader:
    """Reads answers under a request's `OutputRules` with one base's tokenizer (prepared for parsing by
    `tool_templates.prepare_response_parsing`)."""

    def __init__(self, tokenizer, rules: OutputRules | None):
        self.tokenizer, self.rules = tokenizer, rules
        template = getattr(tokenizer, "response_template", None) or {}
        self.opening = template.get("fields", {}).get("tool_calls", {}).get("open")  # e.g. "<tool_call>"
        self.closing = "</tool_call>" if self.opening == "<tool_call>" else None

    @property
    def reads_tool_calls(self) -> bool:
        return self.rules is not None and self.rules.parses_tool_calls

    def message(self, completion_ids: list[int], prompt_ids: list[int], text: str) -> tuple[str | None, list[dict]]:
        """The answer's content and its tool calls (OpenAI's format); `text` is the answer decoded (the content when
        no tools are read)."""
        if not self.reads_tool_calls:
            return text, []
        parsed = parse_tool_calls(self.tokenizer, completion_ids, prompt_ids, list(self.rules.tools))
        calls = openai_tool_calls(parsed)
        closing = self.closing and text.rfind(self.closing)
        if not calls and closing and closing > 0:  # cut short (`max_tokens`) inside a call: the calls before it
            whole = text[: closing + len(self.closing)]
            ids = self.tokenizer(whole, add_special_tokens=False)["input_ids"]
            parsed = parse_tool_calls(self.tokenizer, ids, prompt_ids, list(self.rules.tools))
            calls = openai_tool_calls(parsed)
        content = parsed.get("content") or ""
        return (content or None) if calls else content, calls

    def stream(self, prompt_ids: list[int]) -> "ToolCallStream":
        return ToolCallStream(self, prompt_ids)


class ToolCallStream:
    """One streamed choice's content and tool-call deltas, from its text and tokens as they grow."""

    def __init__(self, reader: AnswerReader, prompt_ids: list[int]):
        self.reader, self.prompt_ids = reader, prompt_ids
        self.content_sent = ""  # the content sent so far
        self.calls_sent: list[dict] = []
        self.in_calls = False  # the opening marker was written: what follows is calls

    def content_delta(self, text: str) -> str:
        """The content to send now, of the answer's text so far: up to the first call, holding back a tail that may
        open one (all of it when the marker is unknown)."""
        opening = self.reader.opening
        if opening is None:
            return ""
        cut = text.find(opening)
        if cut >= 0:
            self.in_calls = True
            text = text[:cut].rstrip("\n")
        else:
            text = text[: len(text) - held_back(text, opening)]
        if not text.startswith(self.content_sent):
            return ""
        delta, self.content_sent = text[len(self.content_sent) :], text
        return delta

    def call_deltas(self, completion_ids: list[int], text: str, final: bool) -> list[dict]:
        """The tool-call deltas to send now: each call completed since the last ones (every call once the answer is
        `final`), as a name delta and an arguments delta."""
        if not self.in_calls and not final:
            return []
        closing_marks = text.count(self.reader.closing) if self.reader.closing else 0
        if not final and closing_marks <= len(self.calls_sent):
            return []
        content, calls = self.reader.message(completion_ids, self.prompt_ids, text)
        ready = calls if final else calls[:closing_marks]
        deltas = []
        for index in range(len(self.calls_sent), len(ready)):
            call = ready[index]
            head = {"index": index, "id": call["id"], "type": "function"}
            deltas.append({**head, "function": {"name": call["function"]["name"], "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
            self.calls_sent.append(call)
        return deltas

    def final_content(self, content: str | None) -> str:
        """The rest of the final content not yet sent (held back, or all of it for an unknown marker); none once a
        call was sent (the text after it is the calls')."""
        content = content or ""
        if not self.calls_sent and content.startswith(self.content_sent):
            rest, self.content_sent = content[len(self.content_sent) :], content
            return rest
        return ""


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
