"""Incremental detokenization: the text of each chunk of tokens, without re-decoding the whole output.

A token can end inside a UTF-8 character (byte-level BPE), and a token's text
can depend on the token before it (a leading space in SentencePiece), so a
chunk's text is the difference between decoding a short window that ends at
the new tokens and the same window without them; text is held back while it
ends in U+FFFD (an incomplete character) and released by `flush` at the end.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0  # tokens[prefix_offset:read_offset] is the context window already emitted
        self.read_offset = 0  # tokens before this offset have had their text emitted

    def push(self, ids: list[int]) -> str:
        """Add generated tokens; the text they complete (may be "" while a character is incomplete)."""
        self.tokens.extend(ids)
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return text[len(prefix):]

    def flush(self) -> str:
        """The text held back so far (at the end of the output)."""
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.tokens[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return text[len(prefix):] if len(text) > len(prefix) else ""
