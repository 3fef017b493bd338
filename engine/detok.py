"""Incremental detokenization: a request's text in O(new tokens) per step, not O(output) (issue 19).

Contract: `IncrementalText.advance(tokenizer, ids)` feeds `ids[consumed:]` to the tokenizers library's
`DecodeStream` (which holds back a token whose bytes end in an incomplete UTF-8 character until it completes)
and returns the text so far. At every prefix of ids the text (1) extends the previous one (streamed text never
retracts), (2) is a prefix of the full decode `Tokenizer.decode(ids)`, and (3) equals it whenever the full decode
ends on a complete character; the simple path, `Tokenizer.decode_prefix_safe` (decode everything, drop one
trailing replacement character), differs only in how much of an incomplete tail it holds back.
tests/test_detok.py checks all three, and the simple path, on random id sequences (byte pieces, special tokens
and out-of-vocabulary ids included). Ids outside the vocabulary render as nothing, as `Tokenizer.decode` does. The finished text is still decoded in full once (engine/output.py), so a request's
final text never depends on this path. Off switch: EngineConfig.incremental_detok=False
(SPECBENCH_INCREMENTAL_DETOK=0) decodes the whole output every step.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from .tokenizer import Tokenizer


class IncrementalText:
    __slots__ = ("_stream", "consumed", "text")

    def __init__(self, skip_special_tokens: bool = True) -> None:
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.consumed = 0
        self.text = ""

    def advance(self, tok: Tokenizer, ids: list[int]) -> str:
        for i in ids[self.consumed:]:
            if 0 <= i < tok.vocab_size:
                piece = self._stream.step(tok.backend, i)
                if piece:
                    self.text += piece
        self.consumed = len(ids)
        return self.text
