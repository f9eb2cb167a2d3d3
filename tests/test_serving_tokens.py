"""Completion tokens as OpenAI's log-probabilities show them (`trl_marl.serving.tokens`): each token's own bytes and
text, for byte-level BPE tokens that hold part of a character and for SentencePiece tokens with a leading space, and
the character offsets of the legacy completions format."""

import json
import random
from functools import partial

import pytest
from test_team_bases import sentencepiece_tokenizer  # noqa: F401  (a fixture)
from transformers import AutoTokenizer

from trl_marl.serving.completion_text import CompletionDecoder, CompletionText, StreamedText, follow_text
from trl_marl.serving.responses import TextStream, chat_logprobs, completion_logprobs
from trl_marl.serving.rows import GeneratedRow, RowRequest
from trl_marl.serving.step_hooks import finish
from trl_marl.serving.tokens import BYTE_OF_CHARACTER, TokenPieces

TEXT = "héllo — 日本"


@pytest.fixture(scope="module")
def smol(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)  # the default model's byte-level BPE tokenizer


def test_byte_level_tokens_give_their_own_bytes_even_inside_a_character(smol):
    ids = smol.encode(TEXT, add_special_tokens=False)
    pieces = TokenPieces(smol)
    assert smol.convert_ids_to_tokens(ids) == ["h", "Ã©", "llo", "ĠâĢĶ", "Ġæ", "Ĺ", "¥", "æľ¬"]
    assert [smol.decode([token]) for token in ids][4:7] == [" \ufffd", "\ufffd", "\ufffd"]  # what decoding alone gives
    assert b"".join(pieces.bytes_of(token) for token in ids) == TEXT.encode()
    assert [pieces.text_of(token) for token in ids] == [
        "h", "é", "llo", " —", "bytes:\\x20\\xe6", "bytes:\\x97", "bytes:\\xa5", "本",
    ]  # fmt: skip
    # "h é l l o ␠ — ␠ 日 本": the three tokens of " 日" start at the space (7) and at 日 (8, 8)
    assert pieces.text_offsets(ids) == [0, 1, 2, 5, 7, 8, 8, 9]
    assert pieces.text_offsets(ids, start=4) == [4, 5, 6, 9, 11, 12, 12, 13]


def test_a_sentencepiece_token_keeps_its_leading_space(sentencepiece_tokenizer):  # noqa: F811
    tokenizer = sentencepiece_tokenizer
    the = tokenizer.convert_tokens_to_ids("\u2581the")
    pieces = TokenPieces(tokenizer)
    assert tokenizer.decode([the]) == "the"  # decoding alone drops it
    assert (pieces.bytes_of(the), pieces.text_of(the)) == (b" the", " the")


def test_text_offsets_match_the_rows_text_past_a_special_token_and_a_sentencepiece_first_space(
    smol,
    sentencepiece_tokenizer,  # noqa: F811
):
    ids = smol.encode("Hello", add_special_tokens=False) + [smol.convert_tokens_to_ids("<|im_start|>")]
    ids += smol.encode(" world", add_special_tokens=False)
    text = smol.decode(ids, skip_special_tokens=True)
    offsets = TokenPieces(smol).text_offsets(ids)
    assert text == "Hello world" and offsets == [0, 5, 5]
    llama = sentencepiece_tokenizer
    ids = llama.encode("the of", add_special_tokens=False)
    text = llama.decode(ids, skip_special_tokens=True)
    offsets = TokenPieces(llama).text_offsets(ids)
    assert text == "the of" and offsets == [0, text.index(" of")]


def test_special_tokens_are_their_decoded_text(smol):
    pieces = TokenPieces(smol)
    assert pieces.text_of(smol.eos_token_id) == smol.eos_token


def test_logprobs_entries_carry_each_tokens_bytes_and_text_offsets_count_from_the_prompt(smol):
    ids = smol.encode(TEXT, add_special_tokens=False)
    row = GeneratedRow(RowRequest(0, [1], 8, top_logprobs=1))
    row.completion_ids, row.logprobs = ids, [-0.5] * len(ids)
    row.top_logprobs = [[(token, -0.5)] for token in ids]
    pieces = TokenPieces(smol)
    content = chat_logprobs(pieces, row)["content"]
    assert [byte for entry in content for byte in entry["bytes"]] == list(TEXT.encode())
    assert content[5]["token"] == "bytes:\\x97" and content[5]["top_logprobs"][0]["bytes"] == [0x97]
    legacy = completion_logprobs(pieces, row, start=3, end=6, prompt_chars=len("Say:"))
    assert legacy["tokens"] == [" —", "bytes:\\x20\\xe6", "bytes:\\x97"]
    assert legacy["text_offset"] == [9, 11, 12]  # 4 prompt characters, then "héllo" ...
    assert legacy["top_logprobs"][0] == {" —": -0.5}


def test_a_token_outside_the_nucleus_gets_openais_floor_not_an_infinity_json_cannot_carry(smol):
    # log-probabilities taken after top-p (a trainer's vLLM engine) give -inf to the tokens top-p removed
    ids = smol.encode("Hi there", add_special_tokens=False)
    row = GeneratedRow(RowRequest(0, [1], 8, top_logprobs=2))
    row.completion_ids, row.logprobs = ids, [-0.25, float("-inf")]
    row.top_logprobs = [[(ids[0], -0.25), (7, float("-inf"))], [(ids[1], float("nan")), (7, -1.5)]]
    pieces = TokenPieces(smol)
    chat = chat_logprobs(pieces, row)["content"]
    assert [entry["logprob"] for entry in chat] == [-0.25, -9999.0]
    assert [[top["logprob"] for top in entry["top_logprobs"]] for entry in chat] == [[-0.25, -9999.0], [-9999.0, -1.5]]
    legacy = completion_logprobs(pieces, row)
    assert legacy["token_logprobs"] == [-0.25, -9999.0]
    assert sorted(legacy["top_logprobs"][0].values()) == [-9999.0, -0.25]
    json.dumps({"chat": chat, "legacy": legacy}, allow_nan=False)  # what FastAPI's response refuses otherwise


def streamed_token_counts(tokenizer, text: str, stop: tuple[str, ...]) -> list[int]:
    """How many tokens a stream's log-probabilities have covered after each token of `text`."""
    decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    row = GeneratedRow(RowRequest(0, [1], 20, stop=stop))
    stream = TextStream(decode, stop)
    counts = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        row.completion_ids.append(token)
        row.logprobs.append(-1.0)
        row.top_logprobs.append([])
        stream.delta(row)
        counts.append(stream.tokens_sent_whole(row))
        stream.tokens_sent = counts[-1]
        assert len(decode(row.completion_ids[: counts[-1]])) <= len(stream.sent)
    return counts


def test_a_streams_log_probabilities_wait_for_their_tokens_text(smol):
    tokens = smol.convert_ids_to_tokens(smol.encode("ab 日本", add_special_tokens=False))
    assert tokens == ["ab", "Ġæ", "Ĺ", "¥", "æľ¬"]
    # " 日" is three tokens: none goes out until the character is whole, then all three with it
    assert streamed_token_counts(smol, "ab 日本", ()) == [1, 1, 1, 4, 5]
    # with a stop string of 4 characters, the text's last 3 characters (and their tokens) are held back
    assert streamed_token_counts(smol, "ab 日本", ("stop",)) == [0, 0, 0, 0, 1]


def test_a_streams_log_probabilities_wait_for_a_token_whose_log_probability_is_not_yet_recorded(smol):
    decode = lambda tokens: smol.decode(tokens, skip_special_tokens=True)  # noqa: E731
    row = GeneratedRow(RowRequest(0, [1], 20))
    row.completion_ids = smol.encode("Hello there world", add_special_tokens=False)
    row.logprobs, row.top_logprobs = [-0.1] * 3, [[]] * 2  # the engine's thread is between its appends
    stream = TextStream(decode, ())
    stream.delta(row)
    assert stream.tokens_sent_whole(row) == 2


# A completion's text decoded token by token (`trl_marl.serving.completion_text`): the incremental text is the whole
# decode's at every token, and costs the row's tokens a bounded number of decodes each.

MIXED_TEXTS = [
    "héllo — 日本語のテキスト",
    "🙂🚀 emoji, 👩‍👩‍👧 family",
    "Ünïcödé ça va? 中文字符",
    "plain words, then more.",
]


@pytest.fixture(scope="module")
def qwen2(other_base_dir):
    return AutoTokenizer.from_pretrained(other_base_dir)  # the second test base's byte-level BPE tokenizer


def random_token_sequences(tokenizer, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """Token sequences mixing pieces of multilingual text (characters of up to four bytes, split across tokens), single
    byte tokens (characters begun and never ended, bytes that are not UTF-8), special tokens and any token at all."""
    rng = random.Random(seed)
    texts = [tokenizer.encode(text, add_special_tokens=False) for text in MIXED_TEXTS]
    byte_tokens = [tokenizer.convert_tokens_to_ids(character) for character in BYTE_OF_CHARACTER]
    byte_tokens = [token for token in byte_tokens if token is not None and token != tokenizer.unk_token_id]
    special = list(tokenizer.added_tokens_decoder)
    sequences = []
    for _ in range(count):
        ids = []
        while len(ids) < length:
            kind = rng.random()
            if kind < 0.3:
                ids += rng.choice(texts)[: rng.randint(1, 8)]
            elif kind < 0.55:
                ids.append(rng.choice(byte_tokens))
            elif kind < 0.65:
                ids.append(rng.choice(special))
            else:
                ids.append(rng.randrange(len(tokenizer)))
        sequences.append(ids[:length])
    return sequences


@pytest.mark.parametrize("name", ["smol", "qwen2"])
def test_a_completions_text_decoded_token_by_token_is_its_whole_decode_after_every_token(name, request):
    tokenizer = request.getfixturevalue(name)
    decoder = CompletionDecoder(tokenizer)
    for ids in random_token_sequences(tokenizer, count=100, length=40):
        streamed, whole = decoder.follow(), CompletionText(decoder)
        assert isinstance(streamed, StreamedText)
        for count, token in enumerate(ids, start=1):
            streamed.append(token)
            whole.append(token)
            text = whole.text_from(0)
            starts = range(len(text) + 1) if text is not None else [0]
            assert [streamed.text_from(start) for start in starts] == [whole.text_from(start) for start in starts]
            assert streamed.decoded_length(count) == whole.decoded_length(count), ids[:count]
            assert streamed.whole_length(count) == whole.whole_length(count), ids[:count]
        characters = len(decoder(ids))
        assert [streamed.tokens_through(n) for n in range(characters + 2)] == [
            whole.tokens_through(n) for n in range(characters + 2)
        ]


@pytest.mark.parametrize("name", ["smol", "qwen2"])
def test_a_stop_string_is_found_token_by_token_at_the_token_where_the_whole_decode_holds_it(name, request):
    tokenizer = request.getfixturevalue(name)
    decoder = CompletionDecoder(tokenizer)
    rng = random.Random(1)
    found = 0
    for ids in random_token_sequences(tokenizer, count=100, length=40, seed=1):
        text = decoder(ids)
        begin = rng.randrange(len(text))
        # a piece of the text (any characters, across tokens), a replacement character (a character not yet whole)
        for stop in [(text[begin : begin + rng.randint(1, 5)], "never seen"), ("\ufffd",)]:
            streamed, whole = decoder.follow(), CompletionText(decoder)
            for count, token in enumerate(ids, start=1):
                streamed.append(token)
                whole.append(token)
                # the engine checks after every token and ends the row at the first that holds one
                assert streamed.reaches(stop) == whole.reaches(stop), (ids[:count], stop)
                if whole.reaches(stop):
                    found += 1
                    break
    assert found > 150


def test_a_tokenizer_not_decoding_byte_by_byte_or_a_plain_decode_function_decodes_the_whole_text(
    smol,
    sentencepiece_tokenizer,  # noqa: F811
):
    # SentencePiece's decoder drops the first space of what it decodes and fuses byte tokens: not streamed
    llama = CompletionDecoder(sentencepiece_tokenizer)
    assert llama.backend is None and type(llama.follow()) is CompletionText
    decode = lambda tokens: smol.decode(tokens, skip_special_tokens=True)  # noqa: E731
    assert type(follow_text(decode)) is CompletionText
    assert isinstance(follow_text(CompletionDecoder(smol)), StreamedText)


def stream_row(
    tokenizer, decode, token_ids: list[int], stop: tuple[str, ...], logprobs: bool = True
) -> tuple[list[str], list[int], GeneratedRow]:
    """A row fed `token_ids` as the engine and a streaming client's handler do, its text decoded with `decode`:
    recorded and checked for its stop strings at each token, streamed (with its log-probabilities and their legacy
    text offsets if `logprobs`), finished at a stop string or at its last token. Its deltas, the tokens sent whole
    after each, the row."""
    pieces = TokenPieces(tokenizer)
    row = GeneratedRow(RowRequest(0, [1], len(token_ids), stop=stop, top_logprobs=1))
    stream = TextStream(decode, stop)
    deltas, counts = [], []
    for token in token_ids:
        row.record(token, -1.0, [(token, -1.0)], decode)
        if stop and row.decoded.reaches(stop):
            finish(row, "stop", decode)
        elif row.remaining_tokens <= 0:
            finish(row, "length", decode)
        deltas.append(stream.delta(row))
        counts.append(stream.tokens_sent_whole(row))
        if logprobs:
            completion_logprobs(pieces, row, stream.tokens_sent, counts[-1])
            stream.tokens_sent = counts[-1]
        if row.done:
            break
    return deltas, counts, row


@pytest.mark.parametrize("name", ["smol", "qwen2"])
def test_a_streamed_row_decoded_token_by_token_streams_and_stops_as_decoded_whole(name, request):
    tokenizer = request.getfixturevalue(name)
    streamed, whole = CompletionDecoder(tokenizer), partial(tokenizer.decode, skip_special_tokens=True)
    rng = random.Random(2)
    for ids in random_token_sequences(tokenizer, count=40, length=30, seed=2):
        text = whole(ids)
        begin = rng.randrange(len(text))
        for stop in [(), (text[begin : begin + rng.randint(1, 4)],)]:
            deltas, counts, row = stream_row(tokenizer, streamed, ids, stop)
            expected_deltas, expected_counts, expected = stream_row(tokenizer, whole, ids, stop)
            assert (deltas, counts) == (expected_deltas, expected_counts)
            assert (row.text, row.finish_reason, row.completion_ids) == (
                expected.text,
                expected.finish_reason,
                expected.completion_ids,
            )
            assert "".join(deltas) == row.text


def test_a_stream_holds_back_all_of_a_text_shorter_than_its_longest_stop_string(smol):
    # "ab" could begin "abcd": none of it goes out before the stop string completes and cuts it all
    ids = smol.encode("ab", add_special_tokens=False) + smol.encode("cd", add_special_tokens=False)
    for decode in (CompletionDecoder(smol), partial(smol.decode, skip_special_tokens=True)):
        deltas, counts, row = stream_row(smol, decode, ids, ("abcd",))
        assert (deltas, counts, row.text, row.finish_reason) == (["", ""], [0, 0], "", "stop")


def test_a_streamed_row_with_a_stop_string_decodes_linearly_many_tokens_not_quadratically(smol, monkeypatch):
    decoded = []  # the number of tokens of each decode
    decode_whole = smol.decode
    monkeypatch.setattr(smol, "decode", lambda ids, **kwargs: decoded.append(len(ids)) or decode_whole(ids, **kwargs))
    text = "日本語 and some words 🙂, " * 40 + "STOP"
    ids = smol.encode(text, add_special_tokens=False)
    stop = ("STOP",)
    # token by token: the tokens of a character split across tokens are decoded together until it is whole, the
    # row's text once at the end (the streaming detokenizer's own decodes, of its last steps' tokens, are in Rust)
    for count in (len(ids) // 2, len(ids)):
        decoded.clear()
        deltas, _, row = stream_row(smol, CompletionDecoder(smol), ids[:count], stop)
        assert sum(decoded) <= 4 * count
    assert row.finish_reason == "stop" and row.text == text.removesuffix("STOP") == "".join(deltas)
    decoded.clear()  # decoded whole at every token, as before: some decodes of the whole text so far per token
    stream_row(smol, partial(smol.decode, skip_special_tokens=True), ids, stop)
    assert sum(decoded) > len(ids) ** 2


def test_without_log_probabilities_a_stream_counts_its_tokens_sent_on_from_its_last_count(smol, monkeypatch):
    # the handler asks after every token how many tokens the text sent holds whole, and sends no log-probabilities
    lengths_read = []
    decoded_length = StreamedText.decoded_length
    monkeypatch.setattr(
        StreamedText, "decoded_length", lambda self, count: lengths_read.append(count) or decoded_length(self, count)
    )
    ids = smol.encode("日本語 and some words 🙂, " * 40, add_special_tokens=False)
    _, counts, _ = stream_row(smol, CompletionDecoder(smol), ids, (), logprobs=False)
    assert counts[-1] == len(ids) and len(lengths_read) <= 2 * len(ids)
