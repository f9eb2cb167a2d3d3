"""OpenAI's response bodies and stream pieces, built from the engine's rows: `chat.completion` and
`text_completion` objects, server-sent events, the text deltas of a stream, `usage`, and log-probabilities in each
endpoint's format."""

import json
from collections.abc import Callable

from .rows import GeneratedRow

# A finished row's reason as OpenAI names it (a cancelled or failed row is not answered).
FINISH_REASON = {"stop": "stop", "length": "length"}


def usage(prompt_tokens: int, rows: list[GeneratedRow]) -> dict:
    completion_tokens = sum(len(row.completion_ids) for row in rows)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, row: GeneratedRow, start: int = 0, end: int | None = None) -> dict:
    """`choices[i].logprobs` of a chat completion for the row's tokens `start:end`."""
    entries = []
    for token_id, logprob, top in zip(
        row.completion_ids[start:end], row.logprobs[start:end], row.top_logprobs[start:end]
    ):
        text = token_text(tokenizer, token_id)
        entries.append(
            {
                "token": text,
                "logprob": logprob,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (other := token_text(tokenizer, other_id)),
                        "logprob": value,
                        "bytes": list(other.encode()),
                    }
                    for other_id, value in top
                ],
            }
        )
    return {"content": entries}


def completion_logprobs(tokenizer, row: GeneratedRow, start: int = 0, end: int | None = None, offset: int = 0) -> dict:
    """`choices[i].logprobs` of a text completion (the legacy format) for the row's tokens `start:end`; `offset` is
    the first token's character offset in the completion's text."""
    tokens, text_offset = [], []
    for token_id in row.completion_ids[start:end]:
        tokens.append(token_text(tokenizer, token_id))
        text_offset.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": row.logprobs[start:end],
        "top_logprobs": [
            {token_text(tokenizer, other_id): value for other_id, value in top} for top in row.top_logprobs[start:end]
        ],
        "text_offset": text_offset,
    }


def chat_completion(
    completion_id: str,
    created: int,
    model: str,
    rows: list[GeneratedRow],
    prompt_tokens: int,
    tokenizer,
    logprobs: bool,
) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": row.text},
                "logprobs": chat_logprobs(tokenizer, row) if logprobs else None,
                "finish_reason": FINISH_REASON[row.finish_reason],
            }
            for index, row in enumerate(rows)
        ],
        "usage": usage(prompt_tokens, rows),
    }


def text_completion(
    completion_id: str,
    created: int,
    model: str,
    rows: list[GeneratedRow],
    prompt_tokens: int,
    tokenizer,
    logprobs: bool,
) -> dict:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": row.text,
                "logprobs": completion_logprobs(tokenizer, row) if logprobs else None,
                "finish_reason": FINISH_REASON[row.finish_reason],
            }
            for index, row in enumerate(rows)
        ],
        "usage": usage(prompt_tokens, rows),
    }


def server_sent_event(payload: dict | str) -> str:
    """One `data:` event; a dict as JSON."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class TextStream:
    """A row's text as stream deltas: what was decoded since the last delta, holding back an incomplete character
    (a trailing U+FFFD) and, with stop strings, the last characters that could begin one (never streamed if the stop
    string completes)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode, self.sent = decode, ""
        self.holdback = max((len(text) for text in stop), default=1) - 1
        self.tokens_sent = 0

    def delta(self, row: GeneratedRow) -> str:
        """The new text of `row`: decoded so far, or, once it is done, its final text (cut before a stop string)."""
        if row.done:
            text = row.text
        else:
            text = self.decode(row.completion_ids)
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - self.holdback] if self.holdback else text
        if not text.startswith(self.sent):  # decoding merged across the last delta: only the final text can tell
            return text[len(self.sent) :] if row.done else ""
        delta, self.sent = text[len(self.sent) :], text
        return delta
