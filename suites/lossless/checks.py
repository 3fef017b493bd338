"""Checks around every lossless run: counters, nothing after EOS, output counts, speculation silently off, KV leaks.

Contract: each check is a pure function of what a run observed (results, a counters delta, a health
snapshot) and returns a `Check` (name, ok, detail); none raises on bad engine output. The speculation
check returns an `AcceptanceEvidence` whose `speculating` is False when the engine never drafted or its mean
accepted length is within `min_accept_len` of 1.0: a lossless pass on such an engine proves nothing and
the verdict says "NOT SPECULATING", never a plain PASS.

Evidence that the candidate speculated (`acceptance_evidence`), first that applies:
1. "per-request": every ok result reports its verify steps (`spec.num_drafts`: the local engine, `specbench
   serve`): drafts and mean accepted length;
2. "counters": the engine's spec counters moved around the requests (a counters delta with num_drafts);
3. "per-request draft tokens": every ok result reports draft and accepted tokens but no verify steps
   (llama.cpp's timings without its counters): speculating when some draft was accepted, not when none was;
4. "stream chunks": streamed results counted exactly per chunk (`counted_exactly`) of which some chunk carried
   several tokens, in a stream of at least two chunks (a non-streamed answer is one chunk by construction):
   one step emitted several tokens, which only speculation does on a server that streams each step (one that
   merges steps into a chunk would pass for speculating: docs/lossless.md);
5. "none": no evidence either way: `speculating` is None, and the gate is CANNOT TEST unless the user asserted
   speculation (`assumed`, --assume-speculating; harness/verdicts.speculation_verdict).
`AcceptanceEvidence.not_measured()` is a gate that sent no candidate request (it says so, not "no counters").

Counter invariants (REFERENCE.md section 3), over a counters delta {num_drafts, num_draft_tokens,
num_accepted_tokens, accepted_per_pos}:
- sum(accepted_per_pos) == num_accepted_tokens;
- accepted_per_pos is non-increasing (a draft at position i+1 is only accepted after position i);
- accepted_per_pos[0] <= num_drafts and num_accepted_tokens <= num_draft_tokens;
- num_draft_tokens <= K x num_drafts, where K = the configured number of speculative tokens. Equality is
  NOT required: a request within K tokens of its max_tokens drafts only remaining - 1 tokens (the
  truncated span), so the product is an upper bound. With K unknown, the length of accepted_per_pos
  (the largest draft length the engine reported) stands in for it.

Output counts (`check_counts`, every result on its own): usage's completion_tokens and the tokens the streamed
chunks carried (where counted exactly) equal the returned ids, no output is longer than its max_tokens, and
finish_reason "length" comes only at max_tokens. `same_tokens_differ`: where the candidate's ids equal the
baseline's whole output (same engine kind), text and finish reason must be equal too (a detokenizer or stop
bug that leaves the ids right).

Acceptance (docs/lossless.md, "The statistics of each rule"):
- `check_acceptance(stats, reference)` is two-sided: the mean accepted length must stay within
  `ACCEPT_REL_TOL` (10%) of the reference's excess over 1, either way. A drop is a drafter or context bug; a
  rise without cause is an acceptance rule that takes near-misses (a tolerance on the target's logit).
- `compare_acceptance(test, ref)` holds accepted vs rejected draft tokens of two runs of the same requests
  (concurrency N vs 1) against each other: two-sided Fisher exact test on the 2x2 table, pooled over the
  requests; FAIL when p < `ACCEPT_ALPHA` (0.001) and the acceptance rate moved by more than
  `ACCEPT_MIN_SHIFT` (0.02). Draft tokens of one step are not independent (a rejection ends the step), so
  the p-value is approximate; the small alpha and the effect floor leave room for that. They do not when the
  draft tokens come from a handful of steps: one fully accepted round of 7 is "7/7" to the token test (p ~ 1e-3
  against a 0.35 rate) but a single observation. So where the runs report their draft rounds (the bundled
  engine per request, counters such as vLLM's num_drafts) each arm needs `ACCEPT_MIN_ROUNDS` (8) rounds for a
  verdict; with fewer the check is skipped and says so (a max-batch gate at concurrency drafts only where a
  request happens to run alone: a few rounds at the tail, the subset a c1 comparison is biased against).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specbench.eos import eos_ids as model_eos_ids
from specbench.harness.adapters.base import EngineAdapter, GenResult, counted_exactly
from specbench.harness.verdicts import NOT_SPECULATING

MIN_ACCEPT_LEN = 1.05  # mean accepted length (incl. the bonus token) at or below this = not speculating
ACCEPT_REL_TOL = 0.10  # the reference bound: 10% of the reference's mean accepted length excess over 1, either way
ACCEPT_ALPHA = 1e-3  # the concurrency-N-vs-1 acceptance test's level (two-sided Fisher exact)
ACCEPT_MIN_SHIFT = 0.02  # ... and the smallest change of the acceptance rate (accepted / drafted) it calls a FAIL
ACCEPT_MIN_ROUNDS = 8  # ... and the draft rounds each arm needs for a verdict, where the runs report rounds


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False  # the engine does not expose what the check needs

    def to_dict(self) -> dict:
        return asdict(self)


COUNTED = ("per-request", "counters")  # sources that count verify steps (drafts): a mean accepted length


def multi_token_chunks(r: GenResult) -> int:
    """Streamed chunks of one result that carried several tokens, where counted exactly, in a stream of at least
    two chunks (a non-streamed answer is one chunk whatever the engine did): 0 otherwise."""
    if not r.ok or len(r.chunk_tokens) < 2 or not counted_exactly(r.token_count_method):
        return 0
    return sum(1 for c in r.chunk_tokens if c > 1)


@dataclass
class AcceptanceEvidence:
    """Speculation during one run: per-request stats (preferred), a counters delta, per-request draft tokens, or
    streamed chunks of several tokens (the module docstring's order)."""

    source: str  # "per-request" | "counters" | "per-request draft tokens" | "stream chunks" | "none" | "not measured"
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    min_accept_len: float = MIN_ACCEPT_LEN
    multi_token_chunks: int = 0  # "stream chunks": chunks that carried several tokens
    assumed: bool = False  # the user asserted that the candidate speculates (--assume-speculating)

    @classmethod
    def not_measured(cls, assumed: bool = False) -> AcceptanceEvidence:
        """A gate that sent no candidate request: nothing was measured (not "the engine has no counters")."""
        return cls("not measured", assumed=assumed)

    @property
    def known(self) -> bool:
        """Verify steps counted (per-request or counters): a mean accepted length exists."""
        return self.source in COUNTED

    @property
    def mean_accept_len(self) -> float | None:
        """Token-weighted acceptance length: 1 + accepted / drafts (REFERENCE.md section 3)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def speculating(self) -> bool | None:
        """True: observed; False: counted, and none (or nothing accepted); None: no evidence either way."""
        if self.source == "per-request draft tokens":
            return self.num_accepted_tokens > 0
        if self.source == "stream chunks":
            return self.multi_token_chunks > 0
        if not self.known:
            return None
        m = self.mean_accept_len
        return m is not None and m > self.min_accept_len

    def describe(self) -> str:
        if self.source == "not measured":
            return "not measured: the gate sent no candidate request"
        if self.source == "per-request draft tokens":
            s = (f"{self.num_draft_tokens} draft tokens, {self.num_accepted_tokens} accepted (per-request counts; no "
                 "verify-step counts, no spec counters)")
            return s if self.speculating else f"{NOT_SPECULATING}: {s}"
        if self.source == "stream chunks":
            return (f"speculation seen in {self.multi_token_chunks} streamed chunks of several tokens (no spec "
                    "counters, no per-request draft counts)")
        if not self.known:
            if self.assumed:
                return ("speculation asserted by the user (--assume-speculating), not observed: no spec counters, no "
                        "per-request draft counts, no streamed chunk of several tokens")
            return ("no evidence that the candidate speculated: no spec counters, no per-request draft counts, no "
                    "streamed chunk of several tokens")
        if not self.num_drafts:
            return f"{NOT_SPECULATING}: zero drafts"
        m = self.mean_accept_len or 1.0
        s = f"{self.num_drafts} drafts, mean accepted length {m:.2f}"
        return s if self.speculating else f"{NOT_SPECULATING}: {s} (<= {self.min_accept_len:.2f})"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_accept_len=self.mean_accept_len, acceptance_rate=self.acceptance_rate,
                 speculating=self.speculating)
        return d


def acceptance_evidence(results: Iterable[GenResult], delta: dict | None,
                        min_accept_len: float = MIN_ACCEPT_LEN, assumed: bool = False) -> AcceptanceEvidence:
    """Per-request spec dicts when every ok result has one with a verify-step count (`num_drafts`), else the
    counters delta, else per-request draft tokens, else streamed chunks of several tokens, else none (the module
    docstring). (llama.cpp's per-request `timings` give draft tokens but no steps, so its evidence comes from the
    `llamacpp:` counters where the server exposes them.) `assumed`: the user asserted speculation."""
    rs = [r for r in results if r.ok]
    if rs and all(r.spec and r.spec.get("num_drafts") is not None for r in rs):
        st = AcceptanceEvidence("per-request", min_accept_len=min_accept_len, assumed=assumed)
        for r in rs:
            sp = r.spec or {}
            st.num_drafts += int(sp.get("num_drafts") or 0)
            st.num_draft_tokens += int(sp.get("num_draft_tokens") or 0)
            st.num_accepted_tokens += int(sp.get("num_accepted_tokens") or 0)
            pp = list(sp.get("accepted_per_pos") or [])
            st.accepted_per_pos = [a + b for a, b in zip(_pad(st.accepted_per_pos, len(pp)),
                                                         _pad(pp, len(st.accepted_per_pos)), strict=True)]
        return st
    if delta and delta.get("num_drafts") is not None:
        return AcceptanceEvidence("counters", int(delta.get("num_drafts") or 0), int(delta.get("num_draft_tokens") or 0),
                                  int(delta.get("num_accepted_tokens") or 0), list(delta.get("accepted_per_pos") or []),
                                  min_accept_len, assumed=assumed)
    counts = [per_request_counts(r) for r in rs]
    if rs and all(c is not None for c in counts):
        return AcceptanceEvidence("per-request draft tokens", 0, sum(c[0] for c in counts if c),
                                  sum(c[1] for c in counts if c), min_accept_len=min_accept_len, assumed=assumed)
    chunks = sum(multi_token_chunks(r) for r in rs)
    if chunks:
        return AcceptanceEvidence("stream chunks", min_accept_len=min_accept_len, multi_token_chunks=chunks,
                                  assumed=assumed)
    return AcceptanceEvidence("none", min_accept_len=min_accept_len, assumed=assumed)


def _pad(xs: list[int], n: int) -> list[int]:
    return xs + [0] * max(0, n - len(xs))


def counter_violations(drafts: int, draft_tokens: int, accepted: int, per_pos: Sequence[int],
                       k: int | None = None) -> list[str]:
    """The invariants any speculation counters obey over one window (empty: consistent). K is `k`, else the
    number of per-position counters. Shared by the lossless gates and the sweep's audit."""
    pp, d, dt, a = [int(x) for x in per_pos], int(drafts), int(draft_tokens), int(accepted)
    bad: list[str] = []
    if min([d, dt, a, *pp], default=0) < 0:
        bad.append(f"a counter went backwards (drafts {d}, draft tokens {dt}, accepted {a}, per position {pp}): "
                   "the server restarted or another process shares the port")
    if pp and sum(pp) != a:
        bad.append(f"sum(accepted_per_pos)={sum(pp)} != accepted={a}")
    inc = [i for i in range(1, len(pp)) if pp[i] > pp[i - 1]]
    if inc:
        bad.append(f"accepted_per_pos increases at position {inc[0]} ({pp[inc[0] - 1]} -> {pp[inc[0]]})")
    if pp and pp[0] > d:
        bad.append(f"accepted_per_pos[0]={pp[0]} > drafts={d}")
    if a > dt:
        bad.append(f"accepted={a} > draft tokens={dt}")
    kk = k if k else (len(pp) or None)
    if kk and dt > kk * d:
        bad.append(f"draft tokens={dt} > K x drafts = {kk} x {d}")
    return bad


def check_counters(stats: AcceptanceEvidence, k: int | None = None) -> Check:
    name = "counters"
    if not stats.known:
        return Check(name, True, "no spec counters exposed", skipped=True)
    pp, d, dt = stats.accepted_per_pos, stats.num_drafts, stats.num_draft_tokens
    bad = counter_violations(d, dt, stats.num_accepted_tokens, pp, k)
    if bad:
        return Check(name, False, "; ".join(bad))
    kk = k if k else (len(pp) or None)
    note = f"K={kk}: draft tokens {dt} <= {kk} x {d} drafts (== unless spans were truncated near max_tokens)" \
        if kk else "no drafts"
    return Check(name, True, note)


def check_after_stop(results: Sequence[GenResult], eos_ids: set[int], ignore_eos: bool = False) -> Check:
    """Nothing is emitted after an EOS token, and a request that stopped has no tokens past the stop."""
    name = "after-eos"
    if not eos_ids or ignore_eos:
        return Check(name, True, "no EOS ids known" if not eos_ids else "ignore_eos", skipped=True)
    bad = []
    for r in results:
        ids = r.output_ids or []
        hits = [i for i, t in enumerate(ids) if t in eos_ids]
        if hits and hits[0] < len(ids) - 1:
            bad.append(f"{r.rid}: {len(ids) - 1 - hits[0]} token(s) after EOS at position {hits[0]}")
    return Check(name, not bad, "; ".join(bad[:5]) or f"no token after an EOS in {len(results)} outputs")


def count_problems(r: GenResult, max_tokens: int | None = None) -> list[str]:
    """What one result's own fields say against its returned ids (any engine, no baseline needed): usage's
    completion_tokens, the tokens the streamed chunks carried (where counted exactly), max_tokens, and a
    finish_reason "length" before max_tokens was reached."""
    if not r.ok or r.output_ids is None:
        return []
    n = len(r.output_ids)
    bad = []
    if r.completion_tokens is not None and r.completion_tokens != n:
        bad.append(f"usage completion_tokens {r.completion_tokens} != {n} returned ids")
    if r.chunk_tokens and counted_exactly(r.token_count_method) and sum(r.chunk_tokens) != n:
        bad.append(f"streamed chunks carried {sum(r.chunk_tokens)} tokens, {n} returned")
    if max_tokens is not None and n > max_tokens:
        bad.append(f"{n} tokens returned for max_tokens={max_tokens}")
    if max_tokens is not None and r.finish_reason == "length" and n < max_tokens:
        bad.append(f"finish_reason 'length' after {n} of max_tokens={max_tokens} tokens")
    return bad


def check_counts(results: Sequence[GenResult], max_tokens: Sequence[int] | None = None) -> Check:
    """`count_problems` over a run's results (max_tokens per result, in order, where known)."""
    name = "output-counts"
    bad = []
    for i, r in enumerate(results):
        m = max_tokens[i] if max_tokens is not None and i < len(max_tokens) else None
        bad += [f"{r.rid}: {x}" for x in count_problems(r, m)]
    n = sum(1 for r in results if r.ok and r.output_ids is not None)
    if not n:
        return Check(name, True, "no output ids to count", skipped=True)
    return Check(name, not bad, "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
                 if bad else f"usage, streamed chunks and finish reasons agree with the ids of {n} outputs")


def same_tokens_differ(cand: GenResult, base: GenResult) -> str | None:
    """Two outputs with the same token ids (same engine kind, same request) must carry the same text and the
    same finish reason; the first difference, or None."""
    if cand.text and base.text and cand.text != base.text:
        k = next((i for i, (a, b) in enumerate(zip(cand.text, base.text, strict=False)) if a != b),
                 min(len(cand.text), len(base.text)))
        return (f"same tokens, different text from character {k}: {cand.text[max(0, k - 20):k + 20]!r} vs "
                f"{base.text[max(0, k - 20):k + 20]!r}")
    if cand.finish_reason and base.finish_reason and cand.finish_reason != base.finish_reason:
        return f"same tokens, finish_reason {cand.finish_reason!r} vs the baseline's {base.finish_reason!r}"
    return None


LOGPROB_SHARE = 0.05  # margin mode: the share of compared positions that may exceed the tolerance (bf16 noise)
LOGPROB_GROSS = 5.0  # ... and no position beyond this many tolerances


@dataclass
class LogprobParity:
    """One request's logprobs against the baseline's over their common prefix (`logprob_parity`)."""

    compared: int = 0  # positions with both arms' logprobs
    missing: int = 0  # positions of the common prefix where the candidate reported none
    worst: float = 0.0  # the largest error of a position (nats)
    worst_at: int | None = None
    over: list[int] = field(default_factory=list)  # positions whose error exceeds the tolerance
    problems: list[str] = field(default_factory=list)  # what each of the first few said


def _position_error(c, b, k: int) -> tuple[float, str]:
    """The largest disagreement at one position (nats) and what it was: the chosen token's logprob, every token
    both top-k lists hold, and a token the baseline ranks inside the candidate's top-k (above its k-th value)
    that the candidate's list lacks (its error: the baseline's value minus the candidate's k-th)."""
    err, what = abs(c.logprob - b.logprob), f"chosen token {c.token_id}: {c.logprob:.4f} vs {b.logprob:.4f}"
    base_top = dict(b.top)
    if b.token_id is not None:
        base_top.setdefault(b.token_id, b.logprob)
    for t, v in c.top.items():
        if t in base_top and abs(v - base_top[t]) > err:
            err, what = abs(v - base_top[t]), f"top token {t}: {v:.4f} vs {base_top[t]:.4f}"
    if c.top and len(c.top) >= k:
        floor = min(c.top.values())
        for t, v in base_top.items():
            if t not in c.top and v - floor > err:
                err, what = v - floor, f"token {t} ({v:.4f} in the baseline) missing from the candidate's top-{k} " \
                                       f"(its last {floor:.4f})"
    return err, what


def logprob_parity(cand: GenResult, base: GenResult, k: int, tol: float) -> LogprobParity:
    """A candidate's returned logprobs against the baseline's (same prompt, greedy, the baseline asked for at
    least k) at every position of their common token prefix, where both computed the same distribution: the
    chosen token's logprob, the common top-k entries and top-k membership must agree within `tol`. Positions
    the candidate left without a logprob (llama.cpp's draft-accepted tokens) are counted as missing."""
    out = LogprobParity()
    cid, bid = list(cand.output_ids or []), list(base.output_ids or [])
    clp, blp = list(cand.logprobs or []), list(base.logprobs or [])
    for i, (a, b) in enumerate(zip(cid, bid, strict=False)):
        if a != b:
            break
        if i >= len(blp) or blp[i].logprob is None:
            continue
        if i >= len(clp) or clp[i].logprob is None:
            out.missing += 1
            continue
        c = clp[i]
        if c.token_id is not None and c.token_id != a:
            err, what = float("inf"), f"the logprobs entry names token {c.token_id}, the output has {a}"
        else:
            err, what = _position_error(c, blp[i], k)
        out.compared += 1
        if err > out.worst:
            out.worst, out.worst_at = err, i
        if err > tol:
            out.over.append(i)
            if len(out.problems) < 3:
                out.problems.append(f"position {i}: {what}")
    return out


def check_logprob_parity(pairs: Sequence[tuple[str, LogprobParity]], tol: float, strict: bool) -> Check:
    """Logprobs parity over a gate's logprobs requests: strict (fp32) = every compared position within `tol`;
    margin (bf16) = at most LOGPROB_SHARE of them over it and none beyond LOGPROB_GROSS x tol. A row-offset,
    draft-model or post-processed logprob is off by far more than either at most positions."""
    name = "logprobs-parity"
    n = sum(p.compared for _, p in pairs)
    missing = sum(p.missing for _, p in pairs)
    if not n:
        return Check(name, True, f"no position to compare ({missing} without a candidate logprob)", skipped=True)
    over = sum(len(p.over) for _, p in pairs)
    worst = max(p.worst for _, p in pairs)
    allowed = 0 if strict else int(LOGPROB_SHARE * n)
    ok = over <= allowed and (strict or worst <= LOGPROB_GROSS * tol)
    rule = f"strict, tol {tol:g}" if strict else f"margin, tol {tol:g}: up to {allowed} over, none beyond " \
                                                 f"{LOGPROB_GROSS * tol:g}"
    detail = f"{n} positions of {len(pairs)} requests ({rule}): {over} over, max |d| {worst:.3g}"
    if missing:
        detail += f"; {missing} positions without a candidate logprob"
    bad = [f"{rid} {x}" for rid, p in pairs for x in p.problems]
    if not ok and bad:
        detail += "; " + "; ".join(bad[:4])
    return Check(name, ok, detail)


def check_speculating(stats: AcceptanceEvidence) -> Check:
    if not stats.known:
        return Check("speculating", True, stats.describe(), skipped=True)
    return Check("speculating", bool(stats.speculating), stats.describe())


def accept_bounds(reference: float, rel_tol: float = ACCEPT_REL_TOL) -> tuple[float, float]:
    """The allowed mean accepted length around a reference: rel_tol of its excess over 1, either way."""
    ex = max(0.0, reference - 1.0)
    return 1.0 + ex * (1.0 - rel_tol), 1.0 + ex * (1.0 + rel_tol)


def check_acceptance(stats: AcceptanceEvidence, reference: float | None, rel_tol: float = ACCEPT_REL_TOL,
                     source: str = "reference", two_sided: bool = True) -> Check:
    """The mean accepted length must stay within rel_tol of the reference's excess over 1: a fall is a drafter /
    context bug, a rise without cause an acceptance rule that takes near-misses (two-sided by default)."""
    name = "acceptance"
    m = stats.mean_accept_len
    if reference is None or m is None:
        return Check(name, True, "no reference acceptance" if reference is None else "no drafts", skipped=True)
    lo, hi = accept_bounds(reference, rel_tol)
    ok = m >= lo and (m <= hi or not two_sided)
    bound = f"[{lo:.3f}, {hi:.3f}]" if two_sided else f">= {lo:.3f}"
    d = f"mean accepted length {m:.3f} vs {source} {reference:.3f} (allowed {bound}: {rel_tol:.0%} of the excess over 1)"
    if m < lo:
        d += ": FELL below the bound"
    elif two_sided and m > hi:
        d += (": ROSE above the bound (acceptance must not rise without cause: a verify rule that accepts "
              "near-misses; re-record the reference if the drafter really improved)")
    return Check(name, ok, d)


@dataclass
class AcceptanceComparison:
    """Accepted / drafted tokens of the same requests in two runs, and the test between them."""

    label: str  # e.g. "c6 vs c1"
    source: str  # "per-request" | "counters" | "none"
    test_drafted: int = 0
    test_accepted: int = 0
    ref_drafted: int = 0
    ref_accepted: int = 0
    p_value: float | None = None
    alpha: float = ACCEPT_ALPHA
    min_shift: float = ACCEPT_MIN_SHIFT
    per_request: list[dict] = field(default_factory=list)  # rid, max_tokens, test/ref drafted and accepted
    test_rounds: int | None = None  # draft rounds (verify steps with drafts) where every request / counter says
    ref_rounds: int | None = None
    min_rounds: int = ACCEPT_MIN_ROUNDS

    @property
    def test_rate(self) -> float | None:
        return self.test_accepted / self.test_drafted if self.test_drafted else None

    @property
    def ref_rate(self) -> float | None:
        return self.ref_accepted / self.ref_drafted if self.ref_drafted else None

    @property
    def too_few_rounds(self) -> bool:
        """Fewer draft rounds than a verdict needs in either arm (only where the rounds are reported)."""
        return any(r is not None and r < self.min_rounds for r in (self.test_rounds, self.ref_rounds))

    @property
    def testable(self) -> bool:
        return (self.source != "none" and bool(self.test_drafted) and bool(self.ref_drafted)
                and not self.too_few_rounds)

    @property
    def failed(self) -> bool:
        if not self.testable or self.p_value is None:
            return False
        shift = abs((self.test_rate or 0.0) - (self.ref_rate or 0.0))
        return self.p_value < self.alpha and shift > self.min_shift

    def describe(self) -> str:
        if self.source == "none":
            return "no per-request draft counts and no spec counters: acceptance cannot be compared"
        if self.test_drafted and self.ref_drafted and self.too_few_rounds:
            return (f"{self.label} ({self.source}): {self.test_rounds} vs {self.ref_rounds} draft rounds, fewer than the "
                    f"{self.min_rounds} a verdict needs in each (the draft tokens of a round are not independent): "
                    f"accepted {self.test_accepted}/{self.test_drafted} vs {self.ref_accepted}/{self.ref_drafted}, "
                    "not tested")
        if not self.testable:
            return f"{self.label}: nothing drafted ({self.test_drafted} vs {self.ref_drafted} draft tokens)"
        s = (f"{self.label} ({self.source}): accepted {self.test_accepted}/{self.test_drafted} = {self.test_rate:.3f} "
             f"vs {self.ref_accepted}/{self.ref_drafted} = {self.ref_rate:.3f}; two-sided Fisher exact p = "
             f"{self.p_value:.3g} (FAIL if p < {self.alpha:g} and the rate moves by > {self.min_shift:g})")
        if self.failed:
            s += ": acceptance " + ("DROPPED" if (self.test_rate or 0) < (self.ref_rate or 0) else "ROSE")
        return s

    def check(self, name: str = "acceptance-vs-c1") -> Check:
        return Check(name, not self.failed, self.describe(), skipped=not self.testable)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(test_rate=self.test_rate, ref_rate=self.ref_rate, failed=self.failed, describe=self.describe())
        return d


def fisher_p(a1: int, n1: int, a2: int, n2: int) -> float:
    """Two-sided Fisher exact p-value of accepted a1 of n1 vs a2 of n2."""
    from scipy.stats import fisher_exact

    return float(fisher_exact([[a1, n1 - a1], [a2, n2 - a2]], alternative="two-sided").pvalue)


def per_request_rounds(r: GenResult) -> int | None:
    """Draft rounds (verify steps that carried drafts) of one request where the engine reports them."""
    n = (r.spec or {}).get("num_drafts")
    return int(n) if n is not None else None


def _total(xs: Iterable[int | None]) -> int | None:
    vals = list(xs)
    return sum(v for v in vals if v is not None) if vals and all(v is not None for v in vals) else None


def per_request_counts(r: GenResult) -> tuple[int, int] | None:
    """(draft tokens, accepted) of one request where the engine reports them (local: spec; llama.cpp: timings)."""
    sp = r.spec or {}
    if sp.get("num_draft_tokens") is None or sp.get("num_accepted_tokens") is None:
        return None
    return int(sp["num_draft_tokens"]), int(sp["num_accepted_tokens"])


def compare_acceptance(test: Sequence[GenResult], ref: Sequence[GenResult], test_delta: dict | None,
                       ref_delta: dict | None, label: str, max_tokens: Sequence[int] | None = None,
                       alpha: float = ACCEPT_ALPHA, min_shift: float = ACCEPT_MIN_SHIFT) -> AcceptanceComparison:
    """The same requests in two runs (index-aligned): per-request counts where every ok pair has them (pooled
    over the pairs), else the two runs' counter deltas, else source "none" (CANNOT TEST)."""
    pairs = [(i, t, r) for i, (t, r) in enumerate(zip(test, ref, strict=True)) if t.ok and r.ok]
    counts = [(i, t, r, per_request_counts(t), per_request_counts(r)) for i, t, r in pairs]
    cmp = AcceptanceComparison(label, "none", alpha=alpha, min_shift=min_shift)
    if counts and all(ct is not None and cr is not None for _, _, _, ct, cr in counts):
        cmp.source = "per-request"
        for i, t, _, ct, cr in counts:
            assert ct is not None and cr is not None
            cmp.test_drafted += ct[0]
            cmp.test_accepted += ct[1]
            cmp.ref_drafted += cr[0]
            cmp.ref_accepted += cr[1]
            cmp.per_request.append({"rid": t.rid, "max_tokens": max_tokens[i] if max_tokens else None,
                                    "test_drafted": ct[0], "test_accepted": ct[1], "ref_drafted": cr[0],
                                    "ref_accepted": cr[1]})
        cmp.test_rounds = _total(per_request_rounds(t) for _, t, _, _, _ in counts)
        cmp.ref_rounds = _total(per_request_rounds(r) for _, _, r, _, _ in counts)
    elif all(d and d.get("num_draft_tokens") is not None and d.get("num_accepted_tokens") is not None
             for d in (test_delta, ref_delta)):
        assert test_delta is not None and ref_delta is not None
        cmp.source = "counters"
        cmp.test_drafted, cmp.test_accepted = int(test_delta["num_draft_tokens"]), int(test_delta["num_accepted_tokens"])
        cmp.ref_drafted, cmp.ref_accepted = int(ref_delta["num_draft_tokens"]), int(ref_delta["num_accepted_tokens"])
        cmp.test_rounds, cmp.ref_rounds = (None if d.get("num_drafts") is None else int(d["num_drafts"])
                                           for d in (test_delta, ref_delta))
    if cmp.testable:
        cmp.p_value = fisher_p(cmp.test_accepted, cmp.test_drafted, cmp.ref_accepted, cmp.ref_drafted)
    return cmp


def check_kv_idle(health: dict | None) -> Check:
    """With nothing running or waiting, every KV page must be back in the pool."""
    name = "kv-leak"
    if not health or health.get("kv_total_pages") is None:
        return Check(name, True, "the engine exposes no KV pool snapshot", skipped=True)
    free, total = health["kv_free_pages"], health["kv_total_pages"]
    busy = (health.get("running") or 0) + (health.get("waiting") or 0)
    if busy:
        return Check(name, False, f"{busy} request(s) still running or waiting after the run")
    return Check(name, free == total, f"{free}/{total} pages free when idle"
                 + ("" if free == total else f": {total - free} page(s) leaked"))


def _model_dir(describe: dict) -> Path | None:
    """The engine's model directory on this machine: a local / hf engine's `model`; for an endpoint, the `root`
    its /v1/models reports (vLLM and `specbench serve` give the model path there) or the local tokenizer
    directory the adapter was given, when that path exists here (the server runs on this host)."""
    server, config = describe.get("server"), describe.get("config")
    server = server if isinstance(server, dict) else {}
    config = config if isinstance(config, dict) else {}
    roots = [m.get("root") for m in (server.get("models") or []) if isinstance(m, dict)]
    for cand in (describe.get("model"), *roots, config.get("tokenizer")):
        if cand and Path(str(cand)).is_dir() and (Path(str(cand)) / "config.json").is_file():
            return Path(str(cand))
    return None


def eos_ids_of(describe: dict) -> set[int]:
    """The EOS ids of the engine's model (`_model_dir`) by specbench/eos.py's rule, the set the engine itself stops
    on (config.json, generation_config.json and the tokenizer's EOS); empty if the model directory is unknown."""
    model = _model_dir(describe)
    return set() if model is None else model_eos_ids(model)


def gate_eos(baseline: EngineAdapter, candidate: EngineAdapter) -> set[int]:
    """The EOS ids a gate judges stops by: the candidate's model's, else the baseline's (`eos_ids_of`)."""
    return eos_ids_of(candidate.describe()) or eos_ids_of(baseline.describe())
