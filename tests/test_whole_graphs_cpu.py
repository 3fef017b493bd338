"""The whole-graph path of the padded runners (engine/piecewise.py `step` / `_direct`, graphs.VerifyGraphs,
dflash_graphs.DraftGraphs with a backend that `plan_rows`) on CPU, fp32, the tiny DFlash pair.

On the GPU the path needs FlashInfer's backend with the Triton span kernel; here a test backend serves it: the
torch reference backend for the K/V store, `row_segments` for the layout and `span_attention_ref` for the
attention, i.e. the kernel's contract. With it installed, greedy generation through the padded verify and draft
runners (eager on CPU) must equal the reference backend's token for token, every verify and draft step must have
run whole, and the prefill-mixed ones piecewise; a segment layout off by one row fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
from span_helpers import staggered

from specbench.engine import LLM, SamplingParams
from specbench.engine.attention.base import AttentionMetadata
from specbench.engine.attention.flashinfer import row_segments
from specbench.engine.attention.torch_ref import TorchAttention
from specbench.kernels import decode_attention as da


class RowsTorch(TorchAttention):
    """TorchAttention with `plan_rows`: the span kernel's contract through its torch reference."""

    name = "torch-rows"
    shift = 0  # a broken layout for the test that the comparison can fail

    def __init__(self, device) -> None:
        super().__init__(device)
        self.rows_planned = 0
        self.caps: list[tuple[int, int, int]] = []  # (rows, segments, room) of each prefill-mixed layout planned
        self._segs: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def rows_ok(self) -> bool:
        return True

    def plan(self, meta: AttentionMetadata) -> None:
        super().plan(meta)
        self._segs = None

    def plan_rows(self, meta: AttentionMetadata, quantum: int = 16, cap: int | None = None) -> None:
        super().plan(meta)  # the K/V store at the step's slots
        segs, pages = row_segments(meta.q_lens, meta.kv_lens, meta.page_tables, meta.page_size, meta.causal, quantum)
        if cap is not None:  # the room a captured graph would have: a layout past it must never be planned
            assert len(segs) <= cap, (len(segs), cap)
            self.caps.append((meta.num_tokens, len(segs), cap))
        if self.shift:
            segs = [(r0, c, b + self.shift * st, st, p0) for r0, c, b, st, p0 in segs]
        self._segs = (torch.tensor(segs, dtype=torch.int32), torch.tensor(pages, dtype=torch.int32))
        self.rows_planned += 1

    def forward(self, q, k, v, k_cache, v_cache, scale):
        if self._segs is None:
            return super().forward(q, k, v, k_cache, v_cache, scale)
        assert self.meta is not None
        k_cache[self.meta.slot_mapping] = k.to(k_cache.dtype)
        v_cache[self.meta.slot_mapping] = v.to(v_cache.dtype)
        return da.span_attention_ref(q, k_cache, v_cache, *self._segs, self.meta.page_size, scale)


def _llm(tiny_target, tiny_draft, rows: RowsTorch | None) -> LLM:
    llm = LLM(tiny_target, draft=tiny_draft, num_pages=256)
    r = llm.engine.runner
    r.use_graph_runner = True  # the padded verify / draft bodies (eager on CPU)
    llm.engine.proposer.use_graphs = True
    if rows is not None:
        r.backend = rows
    return llm


def _generate(llm: LLM, prompts: list[str]) -> list[list[int]]:
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    return [o.output_ids for o in llm.generate(prompts, sp)]


def test_whole_steps_equal_the_reference_backend(tiny_target, tiny_draft, gsm8k_prompts):
    prompts = gsm8k_prompts[:3]
    want = _generate(_llm(tiny_target, tiny_draft, None), prompts)
    rows = RowsTorch("cpu")
    llm = _llm(tiny_target, tiny_draft, rows)
    assert _generate(llm, prompts) == want
    vg, dg = llm.engine.runner.verify_graphs, llm.engine.proposer.graphs
    assert vg is not None and dg is not None and vg.stack.backend is rows and dg.stack.backend is rows
    assert vg.stats["whole_steps"] > 0 and vg.stats["whole_steps"] == vg.stats["steps"] - vg.stats["prefill_steps"]
    assert dg.stats["whole_steps"] == dg.stats["steps"] > 0
    assert rows.rows_planned >= vg.stats["whole_steps"] + dg.stats["whole_steps"]


def test_the_off_switch_runs_piecewise(tiny_target, tiny_draft, gsm8k_prompts):
    rows = RowsTorch("cpu")
    llm = _llm(tiny_target, tiny_draft, rows)
    _generate(llm, gsm8k_prompts[:1])  # builds the stacks
    vg, dg = llm.engine.runner.verify_graphs, llm.engine.proposer.graphs
    for st in (vg.stack, dg.stack):
        st.whole = False
    before = rows.rows_planned
    _generate(llm, gsm8k_prompts[1:2])
    assert rows.rows_planned == before


@pytest.mark.parametrize("shift", [1, -1])
def test_a_wrong_layout_is_caught(tiny_target, tiny_draft, gsm8k_prompts, shift):
    prompts = gsm8k_prompts[:3]
    want = _generate(_llm(tiny_target, tiny_draft, None), prompts)
    rows = RowsTorch("cpu")
    rows.shift = shift  # each causal row sees one key too many / too few
    assert _generate(_llm(tiny_target, tiny_draft, rows), prompts) != want


# ---- prefill-mixed steps whole (EngineConfig.whole_prefill) ------------------------------------------------------
def _staggered(llm: LLM, prompts: list[str]) -> list[list[int]]:
    """A prompt arriving every 3 steps (span_helpers.staggered), 24 tokens each."""
    return staggered(llm.engine, prompts, SamplingParams(max_tokens=24, ignore_eos=True))


def _mixed_llm(tiny_target, tiny_draft, rows: RowsTorch | None, whole_prefill: int, spec: bool) -> LLM:
    kw = {"draft": tiny_draft} if spec else {"spec": "off"}
    llm = LLM(tiny_target, num_pages=256, max_num_batched_tokens=48, whole_prefill=whole_prefill, **kw)
    llm.engine.runner.use_graph_runner = True
    if spec:
        llm.engine.proposer.use_graphs = True
    if rows is not None:
        llm.engine.runner.backend = rows
    return llm


@pytest.mark.parametrize("spec", [False, True])
def test_whole_prefill_mixed_steps_equal_the_reference(tiny_target, tiny_draft, gsm8k_prompts, spec):
    """Prompts arriving while others decode (spec off) or verify (DFlash), chunked at 48 tokens a step: with
    whole_prefill the steps that carry a chunk of <= 32 tokens run whole (one body, every span as segments of <= 16
    rows in the room `mixed_cap` gives), the longer ones piecewise, and the output ids equal the piecewise
    reference backend's token for token."""
    prompts = gsm8k_prompts[:4]
    want = _staggered(_mixed_llm(tiny_target, tiny_draft, None, 0, spec), prompts)
    rows = RowsTorch("cpu")
    llm = _mixed_llm(tiny_target, tiny_draft, rows, 32, spec)
    assert _staggered(llm, prompts) == want
    vg = llm.engine.runner.verify_graphs
    assert vg is not None and vg.stats["whole_prefill_steps"] > 0, vg.stats
    assert vg.stats["whole_prefill_steps"] < vg.stats["prefill_steps"], vg.stats  # chunks past 32: piecewise
    assert rows.caps and all(n <= cap for _, n, cap in rows.caps)
    assert any(n > 2 for _, n, _ in rows.caps)  # layouts of several spans, not only a lone chunk


def test_whole_prefill_off_runs_every_mixed_step_piecewise(tiny_target, tiny_draft, gsm8k_prompts):
    rows = RowsTorch("cpu")
    llm = _mixed_llm(tiny_target, tiny_draft, rows, 0, False)
    _staggered(llm, gsm8k_prompts[:3])
    vg = llm.engine.runner.verify_graphs
    assert vg is not None and vg.stats["prefill_steps"] > 0 and vg.stats["whole_prefill_steps"] == 0
    assert not rows.caps


@pytest.mark.parametrize("shift", [1, -1])
def test_a_wrong_mixed_layout_is_caught(tiny_target, tiny_draft, gsm8k_prompts, shift):
    """Spec off, so the only steps that run whole are the prefill-mixed ones: a causal limit off by one there
    changes the output."""
    prompts = gsm8k_prompts[:3]
    want = _staggered(_mixed_llm(tiny_target, tiny_draft, None, 0, False), prompts)
    rows = RowsTorch("cpu")
    rows.shift = shift
    try:
        got = _staggered(_mixed_llm(tiny_target, tiny_draft, rows, 48, False), prompts)
    except IndexError:  # a row told to read a key past its pages: caught as well
        return
    assert got != want


def test_whole_prefill_is_validated():
    from specbench.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="whole_prefill=-1 is invalid"):
        EngineConfig(model="m", whole_prefill=-1)
    with pytest.raises(ConfigError, match="whole_prefill=4096 is invalid: expected an integer 0 .off. .. "
                                          "max_num_batched_tokens=2048"):
        EngineConfig(model="m", whole_prefill=4096)


def test_whole_prefill_from_the_engine_string(tiny_target):
    from specbench.harness.engines import EngineStringError, build_adapter, parse_engine

    with pytest.raises(EngineStringError, match="whole_prefill"):
        parse_engine("local,whole_prefill=-1")
    ad = build_adapter(f"local:{tiny_target},spec=off,whole_prefill=64,num_pages=64")
    try:
        assert ad.engine.cfg.whole_prefill == 64
    finally:
        ad.close()
