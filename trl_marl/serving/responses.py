"""OpenAI's response bodies and stream pieces, built from the engine's rows: `chat.completion` and
`text_completion` objects, server-sent events, the text deltas of a stream, `usage`, and log-probabilities in each
endpoint's format."""

import json
from collections.abc import Callable

from .completion_text import CompletionText
from .rows import GeneratedRow
from .tokens import TokenPieces

# A finished row's reason as OpenAI names it (a cancelled or failed row is not answered).
FINISH_REASON = {"stop": "stop", "length": "length"}

# The log-probability OpenAI gives a token the sampler could not pick; JSON has no infinity. A token outside the top-p
# nucleus has -inf under log-probabilities taken after top-p (a trainer's vLLM engine, `vllm_generation.py`).
LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    """`logprob`, or `LOGPROB_FLOOR` for -inf (and NaN)."""
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def usage(prompt_tokens: int, rows: list[GeneratedRow]) -> dict:
    completion_tokens = sum(len(row.completion_ids) for row in rows)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_logprobs(pieces: TokenPieces, row: GeneratedRow, start: int = 0, end: int | None = None) -> dict:
    """`choices[i].logprobs` of a chat completion for the row's tokens `start:end`."""

    def entry(token_id: int, logprob: float) -> dict:
        return {
            "token": pieces.text_of(token_id),
            "logprob": _finite(logprob),
            "bytes": list(pieces.bytes_of(token_id)),
        }

    return {
        "content": [
            {**entry(token_id, logprob), "top_logprobs": [entry(other_id, value) for other_id, value in top]}
            for token_id, logprob, top in zip(
                row.completion_ids[start:end], row.logprobs[start:end], row.top_logprobs[start:end]
            )
        ]
    }


def completion_logprobs(
    pieces: TokenPieces, row: GeneratedRow, start: int = 0, end: int | None = None, prompt_chars: int = 0
) -> dict:
    """`choices[i].logprobs` of a text completion (the legacy format) for the row's tokens `start:end`. As in OpenAI's
    legacy completions, `text_offset` counts characters from the start of the prompt (`prompt_chars` long)."""
    end = len(row.completion_ids) if end is None else end
    return {
        "tokens": [pieces.text_of(token_id) for token_id in row.completion_ids[start:end]],
        "token_logprobs": [_finite(logprob) for logprob in row.logprobs[start:end]],
        "top_logprobs": [
            {pieces.text_of(other): _finite(value) for other, value in top} for top in row.top_logprobs[start:end]
        ],
        "text_offset": pieces.text_offsets(row.completion_ids[:end], prompt_chars, first=start, decoded=row.decoded),
    }


def completion_body(
    kind: str,
    completion_id: str,
    created: int,
    model: str,
    rows: list[GeneratedRow],
    prompt_tokens: int,
    pieces: TokenPieces,
    logprobs: bool,
    prompt_chars: list[int],
    messages: list[tuple[str | None, list[dict]]] | None = None,
) -> dict:
    """A `chat.completion` (`kind` "chat") or `text_completion` body of finished `rows`; `prompt_chars[i]` is the
    length of row `i`'s prompt (where a text completion's `text_offset`s start); `messages[i]`, row `i`'s content and
    tool calls as read back (`tool_calls.AnswerReader`; default: its text, no calls)."""

    def choice(index: int, row: GeneratedRow) -> dict:
        finish_reason = FINISH_REASON[row.finish_reason]
        if kind == "chat":
            text, calls = messages[index] if messages is not None else (row.text, [])
            message = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
                finish_reason = "tool_calls" if row.finish_reason == "stop" else finish_reason
            content = {"message": message, "logprobs": chat_logprobs(pieces, row) if logprobs else None}
        else:
            content = {"text": row.text, "logprobs": None}
            if logprobs:
                content["logprobs"] = completion_logprobs(pieces, row, prompt_chars=prompt_chars[index])
        return {"index": index, **content, "finish_reason": finish_reason}

    return {
        "id": completion_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice(index, row) for index, row in enumerate(rows)],
        "usage": usage(prompt_tokens, rows),
    }


def server_sent_event(payload: dict | str) -> str:
    """One `data:` event; a dict as JSON."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class TextStream:
    """A row's text as stream deltas: what was decoded since the last delta, holding back an incomplete character
    (a trailing U+FFFD) and, with stop strings, the last characters that could begin one (never streamed if the stop
    string completes). The text is read from the row's `decoded`, which the engine's thread feeds token by token (a
    row whose tokens were set otherwise is decoded whole with `decode`)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode = decode
        self.sent_pieces: list[str] = []  # the deltas so far
        self.sent_length = 0
        self.holdback = max((len(text) for text in stop), default=1) - 1
        self.tokens_sent = 0  # the tokens whose log-probabilities were sent
        self.tokens_whole = 0  # `tokens_sent_whole`'s last answer, where its next count starts

    @property
    def sent(self) -> str:
        """The text sent so far."""
        return "".join(self.sent_pieces)

    def decoded(self, row: GeneratedRow) -> CompletionText:
        return row.decoded if row.decoded is not None else CompletionText(self.decode, row.completion_ids)

    def tokens_sent_whole(self, row: GeneratedRow) -> int:
        """How many of the row's tokens the text sent so far holds whole (every token once the row is done, its
        tokens past a stop string already dropped): a token's log-probability goes out with its text, never ahead."""
        if row.done:
            return len(row.completion_ids)
        # the engine's thread appends a token, then its log-probability, then the alternatives, then its text: count
        # only tokens whose four entries are all there
        decoded = self.decoded(row)
        recorded = min(len(row.completion_ids), len(row.logprobs), len(row.top_logprobs), decoded.token_count)
        # the sent text only grows: the tokens it held whole at the last count it still holds (and the count goes on
        # from there whether or not log-probabilities were sent)
        count = max(self.tokens_sent, self.tokens_whole)
        while count < recorded and decoded.decoded_length(count + 1) <= self.sent_length:
            count += 1
        self.tokens_whole = count
        return count

    def delta(self, row: GeneratedRow) -> str:
        """The new text of `row`: decoded so far, or, once it is done, its final text (cut before a stop string)."""
        if row.done:
            return self._send(row.text[self.sent_length :])
        decoded = self.decoded(row)
        if decoded.rewrites:
            text = decoded.text_from(0)
            # decoding merged across the last delta: only the final text can tell
            new = text[self.sent_length :] if text is not None and text.startswith(self.sent) else None
        else:
            new = decoded.text_from(self.sent_length)
        return "" if new is None else self._send(new[: max(0, len(new) - self.holdback)])

    def _send(self, delta: str) -> str:
        if delta:
            self.sent_pieces.append(delta)
            self.sent_length += len(delta)
        return delta
