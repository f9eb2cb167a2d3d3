"""The text of a row's completion as the engine's thread records its tokens, decoded incrementally: stop strings,
stream deltas and text offsets then cost each new token's own text, not a decode of the whole completion at every
token (quadratic in its length).

`CompletionDecoder(tokenizer)` decodes completion ids as a row's text (special tokens skipped): whole when called, or
token by token (`follow`). Token by token, the text comes from `tokenizers`' streaming detokenizer (`DecodeStream`)
where that gives exactly the whole decode: a fast tokenizer whose decoder is byte-level BPE alone (Qwen, SmolLM) and
whose `decode` adds nothing to its backend's (no clean-up of spaces). Such a text is its tokens' bytes decoded as
UTF-8, so once the tokens so far end on a whole character, the decode of the tokens after them continues their text
exactly. Any other tokenizer (SentencePiece's first space and byte tokens; a config asking for the clean-up of spaces,
as Llama-3's does; a tokenizer without a `tokenizers` backend) decodes the whole completion when asked, as
`CompletionText` does: the specification that the streamed text is tested against.
"""

import bisect
import json
from collections.abc import Callable, Iterable

from tokenizers.decoders import DecodeStream


def whole_text(decode: Callable[[list[int]], str], token_ids: list[int]) -> str:
    """The text of `token_ids` without a character they end inside of (decoded as U+FFFD)."""
    return decode(token_ids).removesuffix("\ufffd")


def stop_string_index(text: str, stop: tuple[str, ...]) -> int | None:
    """Where the first of the stop strings begins in `text`, or None."""
    found = [text.find(string) for string in stop if string and string in text]
    return min(found) if found else None


def decoder_kinds(tokenizer) -> set[str]:
    """The types of the tokenizer's decoders (a `Sequence`'s members), from its `tokenizers` backend; empty for a
    tokenizer without one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    state = json.loads(decoder.__getstate__())
    return {member["type"] for member in state.get("decoders", [state])}


def streaming_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind `tokenizer` when decoding with it token by token gives exactly the text of
    `tokenizer.decode` (see the module's docstring): its decoder is byte-level BPE alone, and transformers' own
    `decode` does not clean up spaces nor is overridden. None otherwise."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or decoder_kinds(tokenizer) != {"ByteLevel"}:
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    if type(tokenizer).decode is not PreTrainedTokenizerBase.decode or (
        type(tokenizer)._decode is not TokenizersBackend._decode
    ):
        return None
    return backend


class CompletionText:
    """The text of a completion's tokens as they are appended (`append`, from one thread) and read (from any, as of
    some token appended so far), computed by decoding them whole at every read, as the serving engine always did:
    what `StreamedText` computes incrementally.

    Args:
        decode: the decoding of completion ids as a row's text (special tokens skipped).
        token_ids: tokens already generated.
    """

    # Whether a token's text may change the text of the tokens before it (a clean-up of spaces can): a reader of
    # `text_from` checks that the text still begins with what it read before.
    rewrites = True

    def __init__(self, decode: Callable[[list[int]], str], token_ids: Iterable[int] = ()):
        self.decode = decode
        self.token_ids: list[int] = []
        for token_id in token_ids:
            self.append(token_id)

    @property
    def token_count(self) -> int:
        """How many tokens were appended."""
        return len(self.token_ids)

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def text_from(self, start: int = 0) -> str | None:
        """The decode of the tokens so far from its character `start` on, or None while it ends inside a character
        (in U+FFFD)."""
        text = self.decode(self.token_ids)
        return None if text.endswith("\ufffd") else text[start:]

    def decoded_length(self, count: int) -> int:
        """The length of the decode of the first `count` tokens (a character they end inside of is one U+FFFD)."""
        return len(self.decode(self.token_ids[:count]))

    def whole_length(self, count: int) -> int:
        """The length of the first `count` tokens' text without a character they end inside of (`whole_text`)."""
        return len(whole_text(self.decode, self.token_ids[:count]))

    def reaches(self, stop: tuple[str, ...]) -> bool:
        """Whether the decode of the tokens so far holds one of the stop strings. Called after each token appended
        (or each few) until it is True, as the engine ends the row then: `StreamedText` reads only the text that is
        new since the last call."""
        return stop_string_index(self.decode(self.token_ids), stop) is not None

    def tokens_through(self, characters: int) -> int:
        """The fewest of the tokens whose text holds its first `characters` characters whole."""
        return next(
            (count for count in range(self.token_count + 1) if self.whole_length(count) >= characters),
            self.token_count,
        )


class StreamedText(CompletionText):
    """`CompletionText` decoded token by token with `tokenizers`' `DecodeStream`, for a byte-level BPE decoder
    (`streaming_backend`), where it gives the same answers.

    The stream gives the text of each token once it ends on a whole character (the `emitted` pieces); the tokens after
    the last that did (`pending`, those of a character not yet whole) are decoded alone: their bytes continue the
    emitted text, so the emitted pieces and `pending` are the decode of all the tokens. Each token costs a decode of
    the few tokens since the last whole character (and the stream's own of the tokens before them); each length is
    recorded with its token; a read copies only the text asked for, and a stop-string check reads only the text that
    is new since the last check (with the characters before it that a stop string could begin in).

    Args:
        decode: the decoding of completion ids as a row's text, which the pending tokens are decoded with.
        backend: the `tokenizers.Tokenizer` of that decoding.
        token_ids: tokens already generated.
    """

    rewrites = False

    def __init__(self, decode: Callable[[list[int]], str], backend, token_ids: Iterable[int] = ()):
        self.backend = backend
        self.stream = DecodeStream(skip_special_tokens=True)
        self.emitted: list[str] = []  # the stream's pieces: the text of the first `emitted_tokens` tokens
        self.emitted_ends: list[int] = []  # the length of that text after each piece
        self.emitted_tokens = 0
        self.pending = ""  # the decode of the tokens after those: empty, or ending inside a character (in U+FFFD)
        self.decoded_lengths: list[int] = []  # after each token
        self.whole_lengths: list[int] = []
        self.checked_pieces = 0  # how many pieces the stop-string checks read
        self.checked_tail = ""  # the last characters they read, where a stop string could begin
        self.reached = False  # whether a stop-string check found one
        super().__init__(decode, token_ids)

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        piece = self.stream.step(self.backend, token_id)
        if piece is None:
            self.pending = self.decode(self.token_ids[self.emitted_tokens :])
        else:
            self.emitted.append(piece)  # before its end: a reader takes the pieces that have one
            self.emitted_ends.append(self.emitted_length + len(piece))
            self.emitted_tokens, self.pending = len(self.token_ids), ""
        self.decoded_lengths.append(self.emitted_length + len(self.pending))
        self.whole_lengths.append(self.emitted_length + len(self.pending.removesuffix("\ufffd")))

    @property
    def token_count(self) -> int:
        return len(self.whole_lengths)  # appended last: a reader counts a token once all of its entries are there

    @property
    def emitted_length(self) -> int:
        return self.emitted_ends[-1] if self.emitted_ends else 0

    def text_from(self, start: int = 0) -> str | None:
        if self.pending:
            return None
        count = len(self.emitted_ends)  # the pieces as of now, while the engine's thread appends
        first = bisect.bisect_right(self.emitted_ends, start, 0, count)  # the first that ends past `start`
        begin = self.emitted_ends[first - 1] if first else 0
        return "".join(self.emitted[first:count])[start - begin :]

    def decoded_length(self, count: int) -> int:
        return self.decoded_lengths[count - 1] if count > 0 else 0

    def whole_length(self, count: int) -> int:
        return self.whole_lengths[count - 1] if count > 0 else 0

    def reaches(self, stop: tuple[str, ...]) -> bool:
        # a stop string not in the text checked last ends in the text emitted since, or in the pending text
        new = self.checked_tail + "".join(self.emitted[self.checked_pieces :])
        self.reached = self.reached or stop_string_index(new + self.pending, stop) is not None
        overlap = max((len(string) for string in stop), default=1) - 1
        self.checked_pieces, self.checked_tail = len(self.emitted), new[-overlap:] if overlap else ""
        return self.reached


class CompletionDecoder:
    """`tokenizer`'s decoding of completion ids as a row's text (special tokens skipped): whole when called, token by
    token with `follow` (a `StreamedText` where `streaming_backend` finds that exact, else a `CompletionText`)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = streaming_backend(tokenizer)

    def __call__(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def follow(self, token_ids: Iterable[int] = ()) -> CompletionText:
        """The text of `token_ids` and of the tokens appended after them."""
        if self.backend is None:
            return CompletionText(self, token_ids)
        return StreamedText(self, self.backend, token_ids)


def follow_text(decode: Callable[[list[int]], str], token_ids: Iterable[int] = ()) -> CompletionText:
    """The text of `token_ids` and of the tokens appended after them: token by token for a `CompletionDecoder`,
    decoded whole at every read for any other decoding function."""
    if isinstance(decode, CompletionDecoder):
        return decode.follow(token_ids)
    return CompletionText(decode, token_ids)
