"""The lossless gates, one record each: the one list the suite, the self-test, the CLI help and the docs follow.

Contract:
- `REGISTRY` holds a `GateSpec` per gate that `run_lossless` (suite.py) or `specbench selftest` (selftest.py)
  runs, in the order they run it: name, the function, a one-line summary, what it needs (`NEEDS`' words),
  when it runs (`WHEN`), its kind and the faults it is meant to catch (engine/faults.py names, of the greedy
  family; docs/lossless.md "The matrix" measures what each gate does catch).
- `GATES`: the engine gates' name -> gate function (kind "engine"), in that order; a `fresh` gate runs first,
  on an engine nothing has captured a shape on yet (short-then-long), the others after the concurrent gate.
  Every engine gate is `async (baseline, candidate, prompts, max_tokens, opts) -> GateRun` (gates/).
- `SELFTEST_GATES`: the self-test's gates (its columns), in order: every registered gate but the rate and
  batch gates, which run only when asked for, and the gates whose faults the self-test does not arm
  (`selftest=False`: levers, whose paths the self-test's engines never take with their levers off, and
  prefix-cache, whose faults are the prefix family's, armed by `lossless --suite prefix --selftest`).
- A record with a word outside its vocabulary is refused at import (ValueError naming the field, the value
  and what is accepted).
The CLI's --engine-gates help text names the engine gates without importing this module (the CLI imports no
suite at start-up); tests/test_gate_registry.py holds it, and docs/lossless.md's gate table, to this list.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from specbench.harness.adapters.base import EngineAdapter

from .batch import run_batch_invariance, run_rate_gate
from .checks import check_acceptance
from .concurrent import run_concurrent
from .gates.abort_in_flight import abort_in_flight
from .gates.accept_trace import accept_trace
from .gates.eos_in_run import eos_in_run
from .gates.headroom import headroom
from .gates.levers import levers
from .gates.logit_bias import logit_bias
from .gates.long_context import long_context
from .gates.min_tokens import min_tokens
from .gates.mixed import mixed
from .gates.near_ties import near_ties
from .gates.penalties import penalties
from .gates.prefix_cache import prefix_cache
from .gates.short_then_long import short_then_long
from .gates.stop_in_run import stop_in_run
from .greedy import GateRun, GreedyGateOptions, Prompt, run_greedy

Gate = Callable[[EngineAdapter, EngineAdapter, Sequence[Prompt], int, GreedyGateOptions], Awaitable[GateRun]]

# What a gate needs from the engines (required) or uses where offered.
NEEDS = {
    "token_ids": "output token ids from both arms",
    "logprobs": "the baseline's top-k logprobs at a divergence (the regret rule)",
    "spec_evidence": "evidence that the candidate speculated: spec counters, per-request drafts or streamed "
                     "chunks of several tokens",
    "spec_counters": "drafts and accepted tokens counted (spec counters or per-request stats)",
    "candidate_logprobs": "the candidate's logprobs (top 5) on some requests",
    "stop": "stop strings",
    "stop_token_ids": "stop token ids",
    "ignore_eos": "ignore_eos",
    "penalties": "presence and frequency penalties",
    "logit_bias": "a logit bias",
    "min_tokens": "min_tokens",
    "cancel": "a request cancelled mid-generation (the local engine aborts it; an endpoint sees its connection close)",
    "geometry": "the model geometry (max_position_embeddings, usable context): local engines",
    "oracle_drafts": "the adapter capability \"oracle_drafts\" (local engines)",
    "levers": "the adapter capability \"levers\": a fresh engine with a load-aware lever set (local engines)",
    "accepted_runs": "each request's accepted drafts per verify step (spec.accepted_runs) and a drafter the replay "
                     "can run (a local engine's DFlash, DFlash2 or n-gram, its checkpoints named)",
    "cold_path": "a request served cold beside a warm one: a prefix-cache reset route or a per-request cache salt",
}
# When a gate runs: "always" (every lossless run; never advisory), "default" (unless --quick: on by default, so
# advisory when not asked for: its CANNOT TEST is reported beside the verdict), "asked" (only when named).
WHEN = ("always", "default", "asked")
KINDS = ("greedy", "concurrent", "engine", "check", "rate", "batch")


@dataclass(frozen=True)
class GateSpec:
    name: str
    run: Callable[..., Any]  # the gate (an engine gate: `Gate`); "check": the check on the greedy gate's evidence
    summary: str
    kind: str  # greedy | concurrent | engine (GATES) | check (on the greedy gate) | rate | batch
    when: str  # WHEN
    needs: tuple[str, ...] = ()  # NEEDS words, required
    uses: tuple[str, ...] = ()  # NEEDS words, used where offered
    catches: tuple[str, ...] = ()  # fault names (engine/faults.py) it is meant to catch
    fresh: bool = False  # runs first, on a fresh engine
    selftest: bool = True  # a column of `specbench selftest` (False: the gate has a self-test of its own)

    def __post_init__(self) -> None:
        for field_, words, known in (("needs", self.needs, NEEDS), ("uses", self.uses, NEEDS),
                                     ("when", (self.when,), WHEN), ("kind", (self.kind,), KINDS)):
            bad = [w for w in words if w not in known]
            if bad:
                raise ValueError(f"gate {self.name!r}: {field_} {', '.join(bad)} is invalid: expected any of "
                                 f"{', '.join(known)}")

    @property
    def advisory(self) -> bool:
        """On by default: when it runs without being asked for, its CANNOT TEST does not decide the verdict."""
        return self.when == "default"


_JUDGED = ("token_ids", "logprobs")  # every gate judged by the regret rule

REGISTRY: tuple[GateSpec, ...] = (
    GateSpec("short-then-long", short_then_long, "max_tokens 3, 4, 2 one at a time on a fresh engine, then long "
             "requests: the first verify is a truncated span", "engine", "default", _JUDGED,
             catches=("stale_shape",), fresh=True),
    GateSpec("greedy", run_greedy, "each prompt against the baseline, every divergence judged by its regret "
             "(re-anchored after a benign flip)", "greedy", "always", (*_JUDGED, "spec_evidence"),
             uses=("spec_counters",),
             catches=("kv_offset", "skip_rollback", "wrong_bonus", "accept_off_by_one", "mask_leak",
                      "rollback_keeps_page", "verify_pos_shift", "accept_tolerance")),
    GateSpec("concurrent", run_concurrent, "all prompts together with staggered max_tokens, each against its own "
             "baseline; acceptance at cN vs c1", "concurrent", "default", _JUDGED, uses=("spec_counters",),
             catches=("batched_draft_pos", "decode_row_shift")),
    GateSpec("mixed", mixed, "greedy requests beside logprobs requests in one batch; logprobs parity",
             "engine", "default", (*_JUDGED, "candidate_logprobs"), catches=("spec_logprobs_late",)),
    GateSpec("stop-in-run", stop_in_run, "stop strings from the baseline's text, landing inside accepted runs",
             "engine", "default", (*_JUDGED, "stop"), catches=("emit_past_stop", "stop_string_at_run_end")),
    GateSpec("eos-in-run", eos_in_run, "EOS and stop_token_ids inside accepted runs (an oracle drafter where "
             "offered); ignore_eos past an EOS", "engine", "default", (*_JUDGED, "stop_token_ids", "ignore_eos"),
             uses=("oracle_drafts", "spec_counters"),
             catches=("emit_past_stop", "eos_in_run", "ignore_eos_in_run")),
    GateSpec("abort-in-flight", abort_in_flight, "victims cancelled while survivors decode; then one request more",
             "engine", "default", (*_JUDGED, "cancel"), catches=("abort_keeps_pages",)),
    GateSpec("penalties", penalties, "presence and frequency penalties, judged under the penalized scores",
             "engine", "default", (*_JUDGED, "penalties"),
             catches=("verify_ignores_penalties", "verify_penalty_history_stale", "decode_row_shift")),
    GateSpec("logit-bias", logit_bias, "a -100 bias on tokens of the unbiased output, beside an unbiased "
             "neighbour", "engine", "default", (*_JUDGED, "logit_bias"),
             catches=("verify_ignores_logit_bias", "decode_row_shift")),
    GateSpec("min-tokens", min_tokens, "min_tokens with a +100-biased stop token: m tokens without it, then it",
             "engine", "default", (*_JUDGED, "min_tokens", "logit_bias", "stop_token_ids"),
             catches=("min_tokens_at_span_start", "verify_ignores_logit_bias")),
    GateSpec("long-context", long_context, "prompts of about 768 and 1,536 tokens, together on the candidate",
             "engine", "default", _JUDGED, uses=("geometry",), catches=("long_context_pos_shift",)),
    GateSpec("headroom", headroom, "prompt + max_tokens at the usable context served, past it refused cleanly",
             "engine", "default", (*_JUDGED, "geometry")),
    GateSpec("levers", levers, "every prompt at once on fresh engines with a load-aware lever on (gate 1, trim 2, "
             "the automatic policy), each lever shown to act", "engine", "default", (*_JUDGED, "levers"),
             uses=("spec_counters",), selftest=False),
    GateSpec("prefix-cache", prefix_cache, "warm requests (prefix-cache hits: repeats, a shared system prompt, "
             "turns ending at block boundaries) against the same requests cold; a warm turn that stops "
             "speculating fails", "engine", "default", (*_JUDGED, "cold_path"), uses=("spec_counters",),
             selftest=False),
    GateSpec("accept-trace", accept_trace, "every prompt at once; each request's accepted drafts per verify step "
             "against its drafter replayed on its own output (exact in fp32)", "engine", "default",
             ("token_ids", "accepted_runs"), selftest=False),
    GateSpec("near-ties", near_ties, "an oracle drafter proposing the target's runner-up at each prompt's nearest "
             "top-two tie: a verify that accepts it beyond the tolerance fails", "engine", "default",
             (*_JUDGED, "oracle_drafts"), selftest=False),
    GateSpec("acceptance", check_acceptance, "the greedy gate's mean accepted length against the reference, "
             "two-sided", "check", "always", ("spec_counters",), catches=("draft_ctx_misaligned",)),
    GateSpec("divergence-rate", run_rate_gate, "greedy + concurrent divergences per token against the baseline's "
             "own batch noise", "rate", "asked", _JUDGED,
             catches=("accept_tolerance", "kv_offset", "verify_pos_shift")),
    GateSpec("batch-invariance", run_batch_invariance, "both arms at every batch level against their own c1 run; "
             "the spec-on vs spec-off batch-rate test", "batch", "asked", _JUDGED, catches=("kv_offset",)),
)

GATES: dict[str, Gate] = {s.name: cast(Gate, s.run) for s in REGISTRY if s.kind == "engine"}
ENGINE_GATES: tuple[GateSpec, ...] = tuple(s for s in REGISTRY if s.kind == "engine")
SELFTEST_GATES: tuple[GateSpec, ...] = tuple(s for s in REGISTRY if s.kind not in ("rate", "batch") and s.selftest)

