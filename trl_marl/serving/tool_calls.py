"""An answer read back as OpenAI's assistant message: its content and its `tool_calls`, whole or as stream deltas.

A call is parsed by the base's response template (transformers' `parse_response`, through TRL's `parse_response`:
`trl_marl.generation.tool_templates`) and becomes `{"id": "call_...", "type": "function", "function": {"name",
"arguments": <JSON text>}}`; the choice's `finish_reason` is "tool_calls" when the answer ended after calling tools.
With `parallel_tool_calls: false` the answer holds at most one call: the first the model wrote.

For Hermes-style calls (`<tool_call>\\n{...}\\n</tool_call>`: trl_marl's ChatML tool template, Qwen's), the answer is
cut into its calls and the text around them here, the same way whole and streamed (`read_answer`):

- each closed `<tool_call>...</tool_call>` block that parses as one call is that call; one that does not (malformed)
  stays in the content as written; so does a block never closed when the answer ended on its own (its end of
  sequence, a stop string), while one the length limit (`max_tokens`) cut inside is left out, an unfinished call;
- the content is the rest of the text, blocks taken out, with the whitespace at its two ends removed; None when the
  answer holds calls and no other text, as OpenAI gives it.

A stream sends that content as it is written, holding back what may still change: a tail that could open a call, and
trailing whitespace (sent once text follows it); each call goes out once its block is closed, as a first delta with its
index, id, type and name, then one with its arguments. A streamed answer's content and calls are the unstreamed one's.
For another template's calls, the whole answer is parsed at once (TRL falls back to the plain text when a call is
malformed) and a stream sends its content and calls when the answer ends.
"""

import json
import secrets

from ..generation.tool_templates import parse_tool_calls
from .tool_requests import OutputRules

HERMES_OPENING, HERMES_CLOSING = "<tool_call>", "</tool_call>"


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
        self.hermes = self.opening == HERMES_OPENING

    @property
    def reads_tool_calls(self) -> bool:
        return self.rules is not None and self.rules.parses_tool_calls

    def message(
        self, completion_ids: list[int], prompt_ids: list[int], text: str, finish_reason: str
    ) -> tuple[str | None, list[dict]]:
        """The content and tool calls (OpenAI's format) of an answer that ended for `finish_reason` ("length" when the
        length limit cut it); `text` is the answer decoded (the content when no tools are read)."""
        if not self.reads_tool_calls:
            return text, []
        if self.hermes:
            content, calls = self.read_answer(text, prompt_ids, finish_reason)
        else:
            parsed = parse_tool_calls(self.tokenizer, completion_ids, prompt_ids, list(self.rules.tools))
            content, calls = (parsed.get("content") or "").strip(), self.allowed(openai_tool_calls(parsed))
        return (content or None) if calls else content, calls

    def allowed(self, calls: list) -> list:
        """The calls an answer may hold: the first alone without `parallel_tool_calls`."""
        return calls if self.rules.parallel_tool_calls else calls[:1]

    def read_answer(
        self, text: str, prompt_ids: list[int], finish_reason: str | None, parsed_blocks: dict | None = None
    ) -> tuple[str, list[dict]]:
        """The content and calls of a Hermes-style answer's `text` (the module's rules), which ended for
        `finish_reason`, or is still being written (None): the content then leaves out what may still change, an
        unfinished block, a tail that could open one, its trailing whitespace. `parsed_blocks` keeps each block's call
        (or None) between calls, so a stream parses a block once and its call keeps its id."""
        parsed_blocks = {} if parsed_blocks is None else parsed_blocks
        pieces, calls, start = [], [], 0
        while True:
            opening = text.find(HERMES_OPENING, start)
            closing = text.find(HERMES_CLOSING, opening) if opening >= 0 else -1
            if closing < 0:  # no more closed blocks: the rest is text, an unfinished block kept only at a normal end
                cut = finish_reason in (None, "length")
                rest = text[start:] if opening < 0 or not cut else text[start:opening]
                if opening < 0 and finish_reason is None:
                    rest = rest[: len(rest) - held_back(rest, HERMES_OPENING)]
                pieces.append(rest)
                break
            block = text[opening : closing + len(HERMES_CLOSING)]
            if (opening, block) not in parsed_blocks:
                parsed_blocks[opening, block] = self.block_call(block, prompt_ids)
            call = parsed_blocks[opening, block]
            pieces.append(text[start:opening] if call is not None else text[start : closing + len(HERMES_CLOSING)])
            if call is not None:
                calls.append(call)
            start = closing + len(HERMES_CLOSING)
        # whitespace at the ends is not content; before the end, trailing whitespace waits for the text after it
        return "".join(pieces).strip(), self.allowed(calls)

    def block_call(self, block: str, prompt_ids: list[int]) -> dict | None:
        """The call a closed `<tool_call>...</tool_call>` block holds, or None when it does not parse as one."""
        ids = self.tokenizer(block, add_special_tokens=False)["input_ids"]
        calls = openai_tool_calls(parse_tool_calls(self.tokenizer, ids, prompt_ids, list(self.rules.tools)))
        return calls[0] if len(calls) == 1 else None

    def stream(self, prompt_ids: list[int]) -> "ToolCallStream":
        return ToolCallStream(self, prompt_ids)


class ToolCallStream:
    """One streamed choice's content and tool-call deltas, from its text as it grows."""

    def __init__(self, reader: AnswerReader, prompt_ids: list[int]):
        self.reader, self.prompt_ids = reader, prompt_ids
        self.content_sent = ""  # the content sent so far
        self.calls_sent: list[dict] = []
        self._parsed_blocks: dict = {}

    def deltas(self, completion_ids: list[int], text: str, finish_reason: str | None) -> tuple[str, list[dict]]:
        """The content to send now and the tool-call deltas (a name delta and an arguments delta per call) of the
        answer's `text` so far; once it ended (for `finish_reason`, None before), the rest of the message's content
        and calls."""
        reader = self.reader
        if reader.hermes:
            content, calls = reader.read_answer(text, self.prompt_ids, finish_reason, self._parsed_blocks)
        elif finish_reason is not None:
            content, calls = reader.message(completion_ids, self.prompt_ids, text, finish_reason)
            content = content or ""
        else:  # another template's calls are read from the whole answer
            return "", []
        delta = ""
        if content.startswith(self.content_sent):
            delta, self.content_sent = content[len(self.content_sent) :], content
        call_deltas = []
        for index in range(len(self.calls_sent), len(calls)):
            call = calls[index]
            head = {"index": index, "id": call["id"], "type": "function"}
            call_deltas.append({**head, "function": {"name": call["function"]["name"], "arguments": ""}})
            call_deltas.append({"index": index, "function": {"arguments": call["function"]["arguments"]}})
            self.calls_sent.append(call)
        return delta, call_deltas


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
