"""Named faults for the self-test: each reproduces a real bug class of speculative engines.

Contract: an engine holds ONE `Faults` object, `make_faults(EngineConfig.faults)` (unknown names are
refused), and calls one hook per phase that a fault can break:
  propose  `on_propose(spans)` returns the step's `DraftKnobs` (how the batched draft lays out its block
           positions);
  forward  `on_forward(runner, spans, rows, tap, pending)` runs the target forward with the knobs the armed faults
           set (K/V slot shift, drafted rows' position shift, mask leak, no verify graph) and may rewrite
           its logits;
  accept   `accept_rule` is the accept rule the greedy match and the batched speculative-sampling resolve
           compute, and `on_accept(spans, results)` rewrites greedy verify results before anything is
           recorded;
  commit   `on_commit(spans)` returns the step's `CommitKnobs` (drafter context shift, rollback pages
           dropped or kept, tokens emitted past a stop, stop ids honoured only at a run's end);
  abort    `abort_frees`: whether engine.abort gives the request's pages back.
With no fault armed it is `NO_FAULTS`, whose hooks are the plain calls and constants, so the switch costs
nothing when off. The components take generic knobs and never see a fault name; kernels/ know nothing of
faults. `specbench selftest` arms each fault and proves that some gate fails.

Registry: one `Fault` subclass per name, each overriding the hooks of the phase it breaks and naming its
`family` (FAMILIES: which self-test proves it caught) and `expect` (EXPECTS: what that self-test expects with
it armed); a word outside them is refused when the class is defined. `FAULT_TYPES` (name -> class) and `FAULTS`
(name -> description) derive from `_REGISTRY`; the suites read all three facts through the adapter's "faults"
capability (harness/adapters/local.py `fault_catalogue`), never by importing this module. A new fault is one
subclass added to `_REGISTRY`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .spec.sampling import LOSSLESS, AcceptRule

if TYPE_CHECKING:
    from .accept_step import SpanResult
    from .runner import ModelRunner
    from .scheduler import Span
    from .spec.pending import PendingDrafts


@dataclass
class ForwardKnobs:
    """How one step's target forward departs from the rule (see ModelRunner.forward)."""

    slot_shift: list[int] | None = None  # per span: K/V written this many slots late
    pos_shift: list[int] | None = None  # per span: the positions of rows 1.. (the drafted tokens) shifted by this
    mask_leak: list[bool] | None = None  # per span: queries see one key past the causal limit
    verify_graph: bool = True  # False: a non-decode step runs the plain forward


@dataclass(frozen=True)
class DraftKnobs:
    """How one step's draft pass departs from the rule (see DFlashProposer.propose)."""

    tile_starts: bool = False  # block positions from the request starts tiled, not repeated per row
    selector: bool = True  # False: a DFlash2 drafter drafts the logits' argmax, its candidate selector skipped
    causal: bool | None = None  # True / False: the draft layers' causality forced, not the config's

    def overrides(self, variants: tuple[str, ...] = ()) -> dict[str, bool]:
        """The knobs that depart from the rule, as keyword arguments for `Proposer.propose`; `selector` and
        `causal` only for a proposer that names them in `variants` (elsewhere they change nothing)."""
        out: dict[str, bool] = {}
        if self.tile_starts:
            out["tile_starts"] = True
        if not self.selector and "selector" in variants:
            out["selector"] = False
        if self.causal is not None and "causal" in variants:
            out["causal"] = self.causal
        return out


NO_DRAFT_KNOBS = DraftKnobs()


@dataclass(frozen=True)
class CommitKnobs:
    """How one step's commit departs from the rule."""

    draft_shift: int = 0  # the drafter's context rows land this many positions late
    leak_pages: tuple[bool, ...] = ()  # per span: rejected tail pages leave the table but never reach the pool
    keep_pages: tuple[int, ...] = ()  # per span: pages past the committed length the rollback keeps anyway
    emit_past_stop: bool = False  # tokens after a stop inside an accepted run are emitted too
    stop_ids_at_end: bool = False  # EOS / stop_token_ids end a request only as the last token of a step's run
    stop_strings_at_end: bool = False  # stop strings are looked for only at the last token of a step's run
    eos_ignored_at_end_only: bool = False  # ignore_eos holds only for a run's last token: EOS inside a run stops it
    seal_ahead: int = 0  # prefix cache: blocks sealed this many tokens past the committed length (not forwarded)
    publish_on_finish: bool = True  # False: a request finishing this step seals its blocks without the capture

    def leak(self, i: int) -> bool:
        return i < len(self.leak_pages) and self.leak_pages[i]

    def kept(self, i: int) -> int:
        return self.keep_pages[i] if i < len(self.keep_pages) else 0


NO_COMMIT_KNOBS = CommitKnobs()


# Which self-test proves a fault caught (its family), and what that self-test expects with it armed.
FAMILIES = {
    "greedy": "the lossless gates' self-test (`specbench selftest`): some greedy gate must fail",
    "sampling": "the sampled-equivalence gate's self-test (`specbench sampled --selftest`)",
    "prefix": "the prefix gate's self-test (`specbench lossless --suite prefix --selftest`): every other gate's "
              "requests are salted off the prefix cache",
    "draft_variant": "lossless, only a drafter's acceptance moves: no gate can catch it, so no gate's self-test "
                     "arms it; check-draft's acceptance sanity test does (harness/draft_variants.py)",
}
EXPECTS = {
    "fail": "the verdict is FAIL",
    "fallback": "the tokens stay lossless and some warm turn falls back (no drafts where the clean run drafts), "
                "which the prefix gate fails: speculation silently off",
    "acceptance": "the tokens stay lossless and only the mean accepted length moves",
}


class Fault:
    """One named fault: the hooks of the phases it breaks (each default leaves its phase alone)."""

    name: ClassVar[str]
    description: ClassVar[str]
    family: ClassVar[str] = "greedy"  # FAMILIES
    expect: ClassVar[str] = "fail"  # EXPECTS

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for attr, known in (("family", FAMILIES), ("expect", EXPECTS)):
            if getattr(cls, attr) not in known:
                raise TypeError(f"fault {cls.__name__}: {attr} {getattr(cls, attr)!r} is invalid: expected one of "
                                f"{', '.join(known)}")

    def draft(self, spans: list[Span], knobs: DraftKnobs) -> DraftKnobs:
        return knobs

    def forward(self, spans: list[Span], knobs: ForwardKnobs) -> None:
        """Set this step's forward knobs."""

    def logits(self, spans: list[Span], logits: torch.Tensor) -> torch.Tensor:
        return logits

    def rule(self, rule: AcceptRule) -> AcceptRule:
        return rule

    def accept(self, spans: list[Span], results: list[SpanResult]) -> None:
        """Rewrite the step's accept results in place."""

    def commit(self, spans: list[Span], knobs: CommitKnobs) -> CommitKnobs:
        return knobs

    def frees_on_abort(self) -> bool:
        """Whether an aborted request's pages go back to the pool (the abort path, engine.abort)."""
        return True


def _verify(spans: list[Span]) -> list[bool]:
    return [s.kind == "verify" for s in spans]


class KVOffset(Fault):
    name = "kv_offset"
    description = "verify writes its span's K/V one position late (a one-position KV offset)"

    def forward(self, spans: list[Span], knobs: ForwardKnobs) -> None:
        knobs.slot_shift = [int(v) for v in _verify(spans)]
        knobs.verify_graph = False


class SkipRollback(Fault):
    name = "skip_rollback"
    description = "pages of the rejected speculative tail are dropped instead of returned to the pool"

    def commit(self, spans: list[Span], knobs: CommitKnobs) -> CommitKnobs:
        return replace(knobs, leak_pages=tuple(_verify(spans)))


class WrongBonus(Fault):
    name = "wrong_bonus"
    description = "the bonus token is taken one position too late in the target's argmax"

    def accept(self, spans: list[Span], results: list[SpanResult]) -> None:
        for r in results:
            if r.argmax is not None and r.accepted is not None:
                r.tokens = r.tokens[:-1] + [r.argmax[min(r.accepted + 1, r.drafts)]]


class AcceptOffByOne(Fault):
    name = "accept_off_by_one"
    description = "one more draft than matched is accepted"

    def accept(self, spans: list[Span], results: list[SpanResult]) -> None:
        for s, r in zip(spans, results, strict=True):
            if r.argmax is not None and r.accepted is not None and r.accepted < r.drafts:
                m = r.accepted + 1
                r.accepted, r.committed, r.tokens = m, m + 1, list(s.drafts[:m]) + [r.argmax[m]]


class SpecLogprobsLate(Fault):
    name = "spec_logprobs_late"
    description = "a speculated run's logprobs are one position late (token j gets row j + 1's; the last repeats)"

    def accept(self, spans: list[Span], results: list[SpanResult]) -> None:
        for r in results:
            if r.drafts and r.logprobs is not None and len(r.logprobs) > 1:
                r.logprobs = r.logprobs[1:] + r.logprobs[-1:]


class DraftCtxMisaligned(Fault):
    name = "draft_ctx_misaligned"
    description = "the drafter's context rows are appended one position late"

    def commit(self, spans: list[Span], knobs: CommitKnobs) -> CommitKnobs:
        return replace(knobs, draft_shift=1)


class MaskLeak(Fault):
    name = "mask_leak"
    description = "verify queries see one future key (causal mask leak)"

    def forward(self, spans: list[Span], knobs: ForwardKnobs) -> None:
        knobs.mask_leak = _verify(spans)
        knobs.verify_graph = False


class StaleShape(Fault):
    """The first row count seen for a batch size is 'captured'; longer replays read stale rows."""

    name = "stale_shape"
    description = "a verify buffer captured at a short span is replayed for a longer one"

    def __init__(self) -> None:
        self.captured: dict[int, tuple[int, torch.Tensor]] = {}  # spans in the step -> (rows, buffer)

    def forward(self, spans: list[Span], knobs: ForwardKnobs) -> None:
        knobs.verify_graph = False

    def logits(self, spans: list[Span], logits: torch.Tensor) -> torch.Tensor:
        if not any(_verify(spans)):
            return logits
        got = self.captured.get(len(spans))
        if got is None:
            buf = torch.zeros(4096, logits.shape[1], dtype=logits.dtype, device=logits.device)
            buf[: logits.shape[0]] = logits
            self.captured[len(spans)] = (logits.shape[0], buf)
            return logits
        rows, buf = got
        out = logits.clone()
        if logits.shape[0] > rows:
            out[rows:] = buf[rows: logits.shape[0]]
        buf[: min(rows, logits.shape[0])] = logits[:rows]
        return out


class _CommitFlag(Fault):
    """A fault that turns on one boolean field of the commit knobs, `flag`."""

    flag: ClassVar[str]

    def commit(self, spans: list[Span], knobs: CommitKnobs) -> CommitKnobs:
        on: dict[str, Any] = {self.flag: True}  # (CommitKnobs has non-boolean fields beside the flags)
        return replace(knobs, **on)


class EmitPastStop(_CommitFlag):
    name = "emit_past_stop"
    description = "tokens after a stop token inside an accepted run are emitted"
    flag = "emit_past_stop"


# Bug classes that slipped through every token gate at defaults (#18); each a one- or two-line change.
class RollbackKeepsPage(Fault):
    name = "rollback_keeps_page"
    description = "the rollback keeps one page past the committed length (held until the request is freed)"

    def commit(self, spans: list[Span], knobs: CommitKnobs) -> CommitKnobs:
        return replace(knobs, keep_pages=tuple(int(v) for v in _verify(spans)))


class VerifyPosShift(Fault):
    name = "verify_pos_shift"
    description = "the verify forward's drafted tokens sit one position late (the anchor's position is right)"

    def forward(self, spans: list[Span], knobs: ForwardKnobs) -> None:
        knobs.pos_shift = [int(v) for v in _verify(spans)]
        knobs.verify_graph = False


class LongContextPosShift(Fault):
    name = "long_context_pos_shift"
    description = "past position 512 the verify forward's drafted tokens sit one position late (a position-" \
        "dependent bug: a RoPE table, page table or kernel limit that a prompt of a few hundred tokens never reaches)"
    after = 512

    def forward(self, spans: list[Span], knobs: ForwardKnobs) -> None:
        knobs.pos_shift = [int(s.kind == "verify" and s.start >= self.after) for s in spans]
        knobs.verify_graph = False


class BatchedDraftPos(Fault):
    name = "batched_draft_pos"
    description = "the batched draft tiles the requests' block starts (repeat, not repeat_interleave): " \
                  "wrong positions whenever more than one request drafts"

    def draft(self, spans: list[Span], knobs: DraftKnobs) -> DraftKnobs:
        return replace(knobs, tile_starts=True)


class SelectorSkipped(Fault):
    family, expect = "draft_variant", "acceptance"
    name = "selector_skipped"
    description = "a DFlash2 drafter drafts its logits' argmax: the candidate selector is skipped (lossless; " \
                  "only acceptance moves, caught by check-draft's acceptance sanity test)"

    def draft(self, spans: list[Span], knobs: DraftKnobs) -> DraftKnobs:
        return replace(knobs, selector=False)


class CausalDraft(Fault):
    family, expect = "draft_variant", "acceptance"
    name = "causal_draft"
    description = "the draft layers run causal inside the block (causality taken from layer_types, not " \
                  "is_causal: lossless; only acceptance moves, caught by check-draft)"

    def draft(self, spans: list[Span], knobs: DraftKnobs) -> DraftKnobs:
        return replace(knobs, causal=True)


class AcceptTolerance(Fault):
    name = "accept_tolerance"
    description = "a greedy draft is accepted when its target logit is within 0.1 of the max"

    def rule(self, rule: AcceptRule) -> AcceptRule:
        return replace(rule, greedy_tol=0.1)


class RegisterBeforeForward(Fault):
    family = "prefix"
    name = "register_before_forward"
    description = "prefix cache: a block is registered once its last token is known, before that token is " \
                  "forwarded (a verify's bonus completes a block whose last row holds a rejected draft's KV or none)"

    def commit(self, spans: list[Span], knobs: CommitKnobs) -> CommitKnobs:
        return replace(knobs, seal_ahead=1)


class NoPublishOnFinish(Fault):
    family, expect = "prefix", "fallback"
    name = "no_publish_on_finish"
    description = "prefix cache: the blocks a request seals in its last step reach the cache without the " \
                  "drafter's capture (a later hit on them decodes without drafts)"

    def commit(self, spans: list[Span], knobs: CommitKnobs) -> CommitKnobs:
        return replace(knobs, publish_on_finish=False)


class AbortKeepsPages(Fault):
    name = "abort_keeps_pages"
    description = "an aborted request (a client that went away mid-generation) leaves the batch but its KV pages " \
                  "never go back to the pool"

    def frees_on_abort(self) -> bool:
        return False


class EosInRun(_CommitFlag):
    name = "eos_in_run"
    description = "EOS and stop_token_ids are honoured only as the last token of an accepted run"
    flag = "stop_ids_at_end"


class StopStringAtRunEnd(_CommitFlag):
    name = "stop_string_at_run_end"
    description = "stop strings are looked for only once a step's run is appended: the text is cut at the stop, " \
        "but the tokens of the run after it stay in the output ids (and usage)"
    flag = "stop_strings_at_end"


class IgnoreEosInRun(_CommitFlag):
    name = "ignore_eos_in_run"
    description = "with ignore_eos, an EOS inside an accepted run still ends the request (only a run's last " \
        "token, or a plain decode step's, honours ignore_eos)"
    flag = "eos_ignored_at_end_only"


class DecodeRowShift(Fault):
    name = "decode_row_shift"
    description = "in a step that mixes decode and verify spans, a decode span's logits row does not advance the " \
        "row offset: every later span reads its rows shifted back by the decode spans before it"

    def logits(self, spans: list[Span], logits: torch.Tensor) -> torch.Tensor:
        if not any(s.kind == "verify" for s in spans) or not any(s.kind == "decode" for s in spans):
            return logits
        out, r, shift = logits.clone(), 0, 0
        for s in spans:
            n = _logit_rows(s)
            if shift and n:
                idx = (torch.arange(r, r + n, device=logits.device) - shift).clamp(min=0)
                out[r:r + n] = logits[idx]
            shift += int(s.kind == "decode")
            r += n
        return out


def _logit_rows(s: Span) -> int:
    """The logits rows a span gets (engine/forward.py logit_rows)."""
    return len(s.logit_rows())


# Sampling faults (speculative sampling): variants of the accept rule, computed by both resolve paths.
class _RuleFlag(Fault):
    """A fault that turns on one boolean field of the accept rule, `flag`."""

    flag: ClassVar[str]

    def rule(self, rule: AcceptRule) -> AcceptRule:
        return replace(rule, **{self.flag: True})


class BiasedAccept(_RuleFlag):
    family = "sampling"
    name = "biased_accept"
    description = "sampled drafts are accepted with min(1, q/p) instead of min(1, p/q)"
    flag = "q_over_p"


class ResampleFromP(_RuleFlag):
    family = "sampling"
    name = "resample_from_p"
    description = "after a rejection the token is resampled from p instead of the residual"
    flag = "draw_from_p"


class ReusedUniform(_RuleFlag):
    family = "sampling"
    name = "reused_uniform"
    description = "one uniform random number is reused across draft positions"
    flag = "one_uniform"


class QNextRow(_RuleFlag):
    family = "sampling"
    name = "q_next_row"
    description = "a sampled draft's q(d_i) and residual read the draft distribution of the next position (row i + 1)"
    flag = "q_next_row"


class BonusResidual(_RuleFlag):
    family = "sampling"
    name = "bonus_residual"
    description = "after a fully accepted sampled run the bonus is drawn from the residual (p_k - q_{k-1})^+ " \
                  "instead of p_k"
    flag = "bonus_residual"


class UnseededAccept(_RuleFlag):
    family = "sampling"
    name = "unseeded_accept"
    description = "the verify's rejection-sampling uniforms come from the process's generator, not the request's " \
                  "(seeds ignored; the distribution stays exact)"
    flag = "unseeded"


class RowParamsFirst(_RuleFlag):
    family = "sampling"
    name = "row_params_first"
    description = "every sampled verify row of a step is transformed with the first sampled request's temperature " \
                  "/ top-k / top-p (right whenever one sampling config fills the batch)"
    flag = "first_params"


class VerifyIgnoresPenalties(_RuleFlag):
    name = "verify_ignores_penalties"
    description = "penalties (repetition / presence / frequency) are applied on plain decode steps but not on a " \
                  "verify span's rows: drafts are judged on the raw logits"
    flag = "verify_unpenalized"


class VerifyIgnoresLogitBias(_RuleFlag):
    name = "verify_ignores_logit_bias"
    description = "a logit bias is added on plain decode steps but not to a verify span's rows: drafts are " \
                  "judged (and the bonus picked) on the unbiased logits"
    flag = "verify_unbiased"


class VerifyPenaltyHistoryStale(_RuleFlag):
    name = "verify_penalty_history_stale"
    description = "a verify span's rows are penalized with the history before the span: the drafts before each " \
        "row are not counted (repetition / presence / frequency)"
    flag = "verify_history_stale"


class MinTokensAtSpanStart(_RuleFlag):
    name = "min_tokens_at_span_start"
    description = "the min_tokens mask of a verify span's rows is decided by the span's first output position: " \
                  "rows at or past min_tokens still have the stop tokens masked"
    flag = "min_tokens_at_start"


_REGISTRY: tuple[type[Fault], ...] = (KVOffset, SkipRollback, WrongBonus, AcceptOffByOne, DraftCtxMisaligned,
                                      MaskLeak, StaleShape, EmitPastStop, RollbackKeepsPage, VerifyPosShift,
                                      BatchedDraftPos, AcceptTolerance, EosInRun,
                                      BiasedAccept, ResampleFromP, ReusedUniform, QNextRow, BonusResidual,
                                      RegisterBeforeForward, NoPublishOnFinish, SelectorSkipped, CausalDraft,
                                      SpecLogprobsLate, UnseededAccept, AbortKeepsPages, RowParamsFirst,
                                      VerifyIgnoresPenalties, VerifyIgnoresLogitBias, MinTokensAtSpanStart,
                                      StopStringAtRunEnd, DecodeRowShift, VerifyPenaltyHistoryStale,
                                      LongContextPosShift, IgnoreEosInRun)
FAULT_TYPES: dict[str, type[Fault]] = {f.name: f for f in _REGISTRY}
FAULTS: dict[str, str] = {f.name: f.description for f in _REGISTRY}
# The families' members (FAMILIES says why each is apart from the greedy gates' self-test).
DRAFT_VARIANT_FAULTS = frozenset(f.name for f in _REGISTRY if f.family == "draft_variant")
PREFIX_FAULTS = frozenset(f.name for f in _REGISTRY if f.family == "prefix")
# The order armed faults' hooks run in where two touch the same values: one more accepted draft first, then
# the bonus taken late (as the engine always applied them).
_HOOK_ORDER = ("accept_off_by_one", "wrong_bonus")


class Faults:
    """The armed faults of one engine (state included: stale_shape keeps its 'captured' buffers)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        order = [n for n in _HOOK_ORDER if n in names] + [n for n in FAULTS if n in names and n not in _HOOK_ORDER]
        self._armed = [FAULT_TYPES[n]() for n in order]
        rule = LOSSLESS
        for f in self._armed:
            rule = f.rule(rule)
        self.accept_rule: AcceptRule = rule
        self.abort_frees = all(f.frees_on_abort() for f in self._armed)  # engine.abort frees the request's pages

    def on_propose(self, spans: list[Span]) -> DraftKnobs:
        knobs = NO_DRAFT_KNOBS
        for f in self._armed:
            knobs = f.draft(spans, knobs)
        return knobs

    def on_forward(self, runner: ModelRunner, spans: list[Span], rows: list[int], tap: tuple[int, ...],
                   pending: PendingDrafts | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        knobs = ForwardKnobs()
        for f in self._armed:
            f.forward(spans, knobs)
        logits, taps = runner.forward(spans, rows, tap, slot_shift=knobs.slot_shift, pos_shift=knobs.pos_shift,
                                      mask_leak=knobs.mask_leak, verify_graph=knobs.verify_graph, pending=pending)
        for f in self._armed:
            logits = f.logits(spans, logits)
        return logits, taps

    def on_accept(self, spans: list[Span], results: list[SpanResult]) -> None:
        for f in self._armed:
            f.accept(spans, results)

    def on_commit(self, spans: list[Span]) -> CommitKnobs:
        knobs = NO_COMMIT_KNOBS
        for f in self._armed:
            knobs = f.commit(spans, knobs)
        return knobs


class _NoFaults(Faults):
    """Nothing armed: each hook is the phase's plain call."""

    def __init__(self) -> None:
        super().__init__(frozenset())

    def on_propose(self, spans: list[Span]) -> DraftKnobs:
        return NO_DRAFT_KNOBS

    def on_forward(self, runner: ModelRunner, spans: list[Span], rows: list[int], tap: tuple[int, ...],
                   pending: PendingDrafts | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return runner.forward(spans, rows, tap, pending=pending)

    def on_accept(self, spans: list[Span], results: list[SpanResult]) -> None:
        return None

    def on_commit(self, spans: list[Span]) -> CommitKnobs:
        return NO_COMMIT_KNOBS


NO_FAULTS: Faults = _NoFaults()


def make_faults(names: tuple[str, ...] | list[str] | frozenset[str]) -> Faults:
    """The Faults object for these names (NO_FAULTS for none); unknown names raise ValueError."""
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"faults={unknown!r} unknown: expected any of {', '.join(FAULTS)}")
    return Faults(frozenset(names)) if names else NO_FAULTS
