"""Acceptance replay (issue 47, item 1): what a drafter we can run would have proposed at each verify step of a
greedy output, and how many of those drafts that output accepts.

Contract:
- `replay_steps(propose, prompt_ids, output_ids, steps)` replays the drafter at the steps a candidate reports
  ((output tokens committed before the step, drafts verified) each: the bundled engine's `spec.step_at` and
  `spec.step_drafts`): every step is compared whatever chose its draft length (a lever, a policy, max_tokens).
- `replay_trace(propose, prompt_ids, output_ids, k, max_tokens)`, for a candidate that reports only its accepted
  runs, walks a greedy output the way a speculative
  engine commits it: the prefill gives output[0]; then each verify step, with n tokens committed, drafts
  min(k, max_tokens - n - 1) tokens from the context prompt + output[:n] (fewer when the drafter has fewer to
  give: an n-gram miss drafts none and is a plain decode step, not a verify step), accepts the longest prefix of
  the drafts equal to output[n:] (greedy: the output IS the target's argmax, which the other gates check), and
  commits that prefix and one bonus token. The result is one `ReplayStep` per step that drafted, in order:
  the trace a correct engine reports as its per-request accepted runs (engine/request.py SpecStats).
- Each step keeps the drafter's decision margins (score of its pick minus the runner-up's, >= 0) at every slot
  up to and including the first rejected one, so a caller can tell a real difference from a near-tie that
  another engine's arithmetic may break the other way.
- The drafters (`DFlashReplay` for DFlash and DFlash2, `NgramReplay` for prompt lookup) read the checkpoints
  themselves: the target's tapped hidden states come from Hugging Face transformers' Qwen3 (an implementation
  independent of the bundled engine's), one causal pass over prompt + output; the drafter block pass is the
  bundled model's dense reference path (`forward_dense`, the one the paged path is tested against), one request,
  no cache, no graphs, no batching. Slow by design: it is the oracle, not a fast path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Propose = Callable[[Sequence[int], int], tuple[list[int], list[float]]]


@dataclass(frozen=True)
class ReplayStep:
    at: int  # output tokens committed before the step (its anchor is output[at - 1])
    drafted: int
    accepted: int
    margins: tuple[float, ...] = ()  # the drafter's decision margin at slots 0..min(accepted, drafted - 1)

    @property
    def margin(self) -> float | None:
        """The smallest decision margin the step's accepted count depends on (None without margins)."""
        return min(self.margins) if self.margins else None


@dataclass
class ReplayTrace:
    steps: list[ReplayStep] = field(default_factory=list)
    complete: bool = True  # False when the output ran past max_tokens (the walk stopped there)

    @property
    def runs(self) -> list[int]:
        return [s.accepted for s in self.steps]


def replay_trace(propose: Propose, prompt_ids: Sequence[int], output_ids: Sequence[int], k: int,
                 max_tokens: int) -> ReplayTrace:
    """The expected verify steps of a greedy output (module docstring)."""
    out = list(output_ids)
    trace = ReplayTrace(complete=len(out) <= max_tokens)
    n = 1
    while n < len(out):
        kk = min(k, max_tokens - n - 1)
        drafts, margins = propose(list(prompt_ids) + out[:n], kk) if kk >= 1 else ([], [])
        drafts = drafts[:kk]
        if not drafts:
            n += 1  # a plain decode step
            continue
        a = 0
        while a < len(drafts) and n + a < len(out) and drafts[a] == out[n + a]:
            a += 1
        trace.steps.append(ReplayStep(n, len(drafts), a, tuple(margins[:min(a, len(drafts) - 1) + 1])))
        n += a + 1
    return trace


def block_conv(m, x, delta, side: int):
    """DFlash2's convolution along the block from its definition (../shared/REFERENCE-dflash2.md): out[i, c] =
    sum_t (base[side, t, c] + delta[i, side, t, c // group]) * x[i - t, c], zero where i - t < 0 (no tap reads
    across the block's start). m: the GroupedDynamicConv holding `base`, `kernel`, `group`; x [N, S, H]; delta
    [N, S, 2, K, G]. One slot and one tap at a time: the oracle for the engine's shifted-sum form."""
    out = x.new_zeros(x.shape)
    for i in range(x.shape[1]):
        for t in range(m.kernel):
            if i - t >= 0:
                w = m.base[side, t].to(x.dtype) + delta[:, i, side, t].repeat_interleave(m.group, dim=-1)
                out[:, i] += w * x[:, i - t]
    return out


def replay_steps(propose: Propose, prompt_ids: Sequence[int], output_ids: Sequence[int],
                 steps: Sequence[tuple[int, int]]) -> list[ReplayStep]:
    """The replayed drafter at the candidate's own steps: for each (at, drafted) the candidate reports, what the
    drafter proposes from prompt + output[:at] (its first `drafted` tokens) and how many of them output[at:]
    accepts. Every step is compared, whatever chose its draft length (a lever, a policy, max_tokens)."""
    out, pid = list(output_ids), list(prompt_ids)
    res = []
    for at, k in steps:
        if not 1 <= at <= len(out) or k < 1:
            res.append(ReplayStep(at, k, -1))  # no such step: the caller reports it
            continue
        drafts, margins = propose(pid + out[:at], k)
        drafts = drafts[:k]
        a = 0
        while a < len(drafts) and at + a < len(out) and drafts[a] == out[at + a]:
            a += 1
        res.append(ReplayStep(at, len(drafts), a, tuple(margins[:min(a, len(drafts) - 1) + 1]) if drafts else ()))
    return res


def draft_block_size(draft_dir: str | Path) -> int:
    """A DFlash drafter checkpoint's block size, as the bundled engine reads its config."""
    from specbench.engine.models.dflash2 import load_draft_config  # noqa: PLC0415

    return int(load_draft_config(draft_dir).block_size or 0)


class NgramReplay:
    """Prompt lookup as the bundled engine drafts it (the longest suffix n-gram, ngram_max down to ngram_min, at
    its most recent earlier occurrence; the tokens that followed). Margins are not defined (a lookup has no
    scores): every slot's margin is infinite."""

    def __init__(self, nmin: int = 1, nmax: int = 4) -> None:
        self.nmin, self.nmax = nmin, nmax

    def __call__(self, ids: Sequence[int], k: int) -> tuple[list[int], list[float]]:
        ids = list(ids)
        m = len(ids)
        for n in range(min(self.nmax, m - 1), self.nmin - 1, -1):
            suffix = ids[m - n:]
            for start in range(m - n - 1, -1, -1):
                if ids[start:start + n] == suffix:
                    follow = ids[start + n:start + n + k]
                    if follow:
                        return follow, [float("inf")] * len(follow)
        return [], []


class DFlashReplay:
    """A DFlash (or DFlash2) drafter on Hugging Face's target: `taps(ids)` once per sequence, then `__call__` per
    step reads the taps of the context it is given (a prefix of that sequence)."""

    def __init__(self, target_dir: str | Path, draft_dir: str | Path, dtype: str = "float32",
                 device: str = "cpu") -> None:
        import torch  # noqa: PLC0415  (the harness imports torch only where it runs a model)
        import transformers  # noqa: PLC0415

        from specbench.engine.config import ModelConfig  # noqa: PLC0415
        from specbench.engine.models.dflash2 import DFlash2DraftModel, drafter_class, load_draft_config  # noqa: PLC0415
        from specbench.engine.rope import RotaryCache  # noqa: PLC0415

        self.torch, self.device = torch, device
        self.dtype = getattr(torch, dtype)
        auto: Any = transformers.AutoModelForCausalLM
        self.hf: Any = auto.from_pretrained(str(target_dir), dtype=self.dtype).to(device).eval()
        dcfg, tcfg = load_draft_config(draft_dir), ModelConfig.from_dir(target_dir)
        self.d: Any = drafter_class(dcfg).load(draft_dir, dcfg, tcfg, self.dtype, device)
        self.v2 = isinstance(self.d, DFlash2DraftModel)
        if self.v2:  # the block convolutions written from their definition, not the engine's vectorised code
            d2: Any = self.d
            for conv in [*d2.attn_convs, *d2.mlp_convs]:
                conv.conv = functools.partial(block_conv, conv)
        self.embed = self.hf.get_input_embeddings().weight
        self.lm_head = self.hf.get_output_embeddings().weight
        self.rope = RotaryCache(self.d.cfg, device, self.dtype, max_pos=tcfg.max_position_embeddings)
        self.block = self.d.block_size
        self._seq: tuple[int, ...] = ()
        self._taps = None

    def taps(self, ids: Sequence[int]) -> None:
        """Compute the target's tapped hidden states of `ids` (prompt + the whole output) once."""
        torch = self.torch
        with torch.no_grad():
            hs = self.hf(torch.tensor([list(ids)], device=self.device), output_hidden_states=True).hidden_states
        self._taps = torch.cat([hs[i + 1][0] for i in self.d.target_layer_ids], dim=-1)
        self._seq = tuple(ids)

    def __call__(self, ids: Sequence[int], k: int) -> tuple[list[int], list[float]]:
        torch = self.torch
        c = len(ids) - 1  # context rows: every committed token but the anchor
        if self._taps is None or tuple(ids) != self._seq[:len(ids)]:
            self.taps(ids)
        assert self._taps is not None
        d, b, dev = self.d, self.block, self.device
        block = torch.tensor([[ids[-1]] + [d.mask_token_id] * (b - 1)], device=dev)
        with torch.no_grad():
            emb = torch.nn.functional.embedding(block, self.embed) * d.input_embedding_scale
            h = d.forward_dense(self._taps[None, :c], torch.arange(c, device=dev)[None],
                                torch.ones(1, c, dtype=torch.bool, device=dev), emb,
                                torch.arange(c, c + b, device=dev)[None], self.rope)[:, 1:]
            if self.v2:
                drafts, margins = self._selector_path(h, ids[-1])
            else:
                logits = torch.nn.functional.linear(h, self.lm_head).float()[0]
                top = logits.topk(2, dim=-1)
                drafts = top.indices[:, 0].tolist()
                margins = (top.values[:, 0] - top.values[:, 1]).tolist()
        return drafts[:k], margins[:k]

    def _selector_path(self, h, anchor: int) -> tuple[list[int], list[float]]:
        """DFlash2's greedy selector walk (engine/spec/selector.py's `greedy_path`), with each slot's margin: the
        best candidate's edge score minus the runner-up's, given the chosen predecessor."""
        torch = self.torch
        from specbench.engine.spec import selector as sel  # noqa: PLC0415

        d = self.d
        logits = d.draft_logits(h, self.lm_head)
        unary, cand = sel.candidates(logits, d.selector_top_k)
        proj = sel.project(h, d.sel_proj)
        prev = torch.tensor([anchor], device=h.device)
        drafts, margins = [], []
        for j in range(cand.shape[1]):
            s = sel._edge(unary[:, j], cand[:, j], proj[:, j], prev, d.sel_pred, d.sel_succ)[0]
            top = s.topk(min(2, s.numel()))
            prev = cand[:, j, top.indices[0]]  # [1]
            drafts.append(int(prev))
            margins.append(float(top.values[0] - top.values[1]) if top.values.numel() > 1 else float("inf"))
        return drafts, margins
