"""Each completion token as OpenAI's log-probabilities show it: its own bytes, and its text (`bytes:\\xNN...` when
those bytes are not whole UTF-8 characters, as OpenAI writes them), and the character offsets of a completion's tokens.

Decoding a token alone gives neither for the tokens that matter most here: a byte-level BPE token holding part of a
character decodes to U+FFFD (its bytes lost), and a SentencePiece token alone drops its leading space. So the bytes are
read from the token's vocabulary entry by the tokenizer's own decoding scheme: byte-level BPE (GPT-2, Llama-3, Qwen,
SmolLM: each character of the entry stands for one byte), SentencePiece (`▁` for a space, `<0xNN>` for a byte the
vocabulary lacks). Special tokens, and tokenizers of other kinds, fall back to decoding the token alone.
"""

import re

from .completion_text import CompletionDecoder, CompletionText, decoder_kinds

BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")
METASPACE = "\u2581"


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, reversed: printable Latin-1 bytes are their own character, the other
    bytes are the characters from U+0100 on, in byte order (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in characters]
    characters.update({byte: chr(256 + index) for index, byte in enumerate(others)})
    return {character: byte for byte, character in characters.items()}


BYTE_OF_CHARACTER = byte_level_alphabet()


class TokenPieces:
    """The bytes and text of `tokenizer`'s tokens, one by one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decode = CompletionDecoder(tokenizer)  # as a row's text
        kinds = decoder_kinds(tokenizer)
        self.byte_level = "ByteLevel" in kinds
        self.sentencepiece = bool(kinds & {"Metaspace", "Replace", "ByteFallback"})
        self.special = set(tokenizer.all_special_ids)

    def bytes_of(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id not in self.special and isinstance(piece, str):
            if self.byte_level and all(character in BYTE_OF_CHARACTER for character in piece):
                return bytes(BYTE_OF_CHARACTER[character] for character in piece)
            if self.sentencepiece:
                byte = BYTE_FALLBACK.fullmatch(piece)
                return bytes([int(byte.group(1), 16)]) if byte else piece.replace(METASPACE, " ").encode()
        return self.tokenizer.decode([token_id]).encode()

    def text_of(self, token_id: int) -> str:
        """The token's text, or `bytes:` and its bytes escaped (`bytes:\\xe6\\x97`) when they end inside a
        character."""
        raw = self.bytes_of(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)

    def text_offsets(
        self, token_ids: list[int], start: int = 0, first: int = 0, decoded: CompletionText | None = None
    ) -> list[int]:
        """The character offsets of tokens `first:` in the text of `token_ids` as a row's text decodes it (special
        tokens skipped, a SentencePiece text's first space dropped), counted from `start`: the whole characters of the
        tokens before each (a token that continues a character shares that character's offset). `decoded`: the text
        that follows these tokens already (a row's `decoded`; at least `token_ids`), else they are decoded here."""
        decoded = decoded if decoded is not None else self.decode.follow(token_ids)
        return [start + decoded.whole_length(index) for index in range(first, len(token_ids))]
