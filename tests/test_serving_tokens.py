"""Completion tokens as OpenAI's log-probabilities show them (`trl_marl.serving.tokens`): each token's own bytes and
text, for byte-level BPE tokens that hold part of a character and for SentencePiece tokens with a leading space, and
the character offsets of the legacy completions format."""

import json

import pytest
from test_team_bases import sentencepiece_tokenizer  # noqa: F401  (a fixture)
from transformers import AutoTokenizer

from trl_marl.serving.responses import TextStream, chat_logprobs, completion_logprobs
from trl_marl.serving.rows import GeneratedRow, RowRequest
from trl_marl.serving.tokens import TokenPieces

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
