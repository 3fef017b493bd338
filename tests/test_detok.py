"""Incremental detokenization (engine/detok.py) against the simple path it replaces (issue 19)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbench.engine import LLM, SamplingParams
from specbench.engine.detok import IncrementalText
from specbench.engine.tokenizer import Tokenizer
from specbench.harness.fixtures import bundled_pair

TARGET, DRAFT = (str(p) for p in bundled_pair())
TOK = Tokenizer(TARGET)
# Byte pieces (ids whose token is one byte-level character) make incomplete UTF-8 sequences likely.
BYTE_IDS = [i for i in range(TOK.vocab_size) if len(TOK.id_to_token(i)) == 1][:256]
ids_strategy = st.lists(st.one_of(st.sampled_from(BYTE_IDS), st.integers(-3, TOK.vocab_size + 3)),
                        min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(ids_strategy)
def test_stream_extends_is_a_prefix_and_equals_full_decode_on_complete_characters(ids: list[int]) -> None:
    inc, prev = IncrementalText(), ""
    for j in range(1, len(ids) + 1):
        text = inc.advance(TOK, ids[:j])
        full = TOK.decode(ids[:j])
        assert text.startswith(prev), "streamed text retracted"
        assert full.startswith(text), "streamed text is not a prefix of the full decode"
        if not full.endswith("\ufffd"):
            assert text == full
        simple = TOK.decode_prefix_safe(ids[:j])
        assert simple.startswith(text) or text.startswith(simple)  # they differ only in what they hold back
        prev = text


def test_stream_holds_an_incomplete_character_then_releases_it() -> None:
    ids = TOK.encode("naïve café ☕ done")
    pieces = [i for i in ids if "\ufffd" in TOK.decode([i])]
    assert pieces, "the tiny tokenizer should split a multibyte character over byte pieces"
    inc = IncrementalText()
    seen = [inc.advance(TOK, ids[:j]) for j in range(1, len(ids) + 1)]
    assert all("\ufffd" not in s for s in seen)
    assert seen[-1] == TOK.decode(ids) == "naïve café ☕ done"


def test_advance_consumes_only_new_ids() -> None:
    inc = IncrementalText()
    ids = TOK.encode("hello world, again and again")
    inc.advance(TOK, ids[:3])
    inc.advance(TOK, ids[:3])  # no new ids: no change
    assert inc.consumed == 3 and inc.text == TOK.decode(ids[:3])
    assert inc.advance(TOK, ids) == TOK.decode(ids)


@pytest.mark.parametrize("stop", [None, [" the", "e a", "."]])
def test_engine_outputs_equal_with_incremental_detok_on_and_off(stop) -> None:
    prompts = ["The quick brown fox", "Once upon a time, there was", "Question: what is 2 + 2?"]
    sp = SamplingParams(max_tokens=40, temperature=0.0, stop=stop)
    runs = {}
    for on in (True, False):
        llm = LLM(TARGET, draft=DRAFT, incremental_detok=on)
        assert llm.engine.output.incremental is on
        streamed: dict[str, list[str]] = {}
        ids = [llm.engine.add_request(p, sp) for p in prompts]
        final = {}
        while len(final) < len(ids):
            for out in llm.engine.step():
                streamed.setdefault(out.rid, []).append(out.text)
                if out.finished:
                    final[out.rid] = out
        runs[on] = ([(final[r].output_ids, final[r].text, final[r].finish_reason, final[r].stop_reason) for r in ids],
                    [streamed[r] for r in ids])
        for texts in runs[on][1]:  # every snapshot extends the last and is a prefix of the final text
            for a, b in zip(texts, texts[1:], strict=False):
                assert b.startswith(a) or b == texts[-1]
    assert runs[True][0] == runs[False][0]
