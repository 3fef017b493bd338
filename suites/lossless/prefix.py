"""The prefix gate (`specbench lossless --suite prefix`): a warm request must be the same request run cold.

Contract: one engine (any adapter), its prefix cache on. Per case, a warm-up request fills the cache, then
the warm request (it shares a prefix with the warm-up) is compared with the same request run cold:
- cold = the cache flushed (`reset_prefix_cache`: the local engine, vLLM's POST /reset_prefix_cache,
  SGLang's /flush_cache) or the request salted off it (`prompt_cache=False` where `cold_requests()`: a
  fresh cache salt per request); with neither the gate is CANNOT TEST;
- first-token drift: the largest |warm - cold| logprob over the top-k of the first generated position (a
  one-token request with logprobs). It must stay within the tolerance: `noise_factor` x the engine's
  measured cold-vs-cold noise (every case runs cold twice) or the floor for its dtype, whichever is larger;
- the greedy regret rule (regret.py) on the warm continuation against the cold one: at the first
  divergence the warm pick is judged under the cold distribution there (the tolerance greedy.resolve_rule
  decides: strict in fp32, the margin otherwise).
A case fails naming its conversation and its boundary case. Cases (per conversation, per block size):
  repeat        the same prompt twice (the whole prompt but its last block comes from the cache);
  system        two questions behind one shared system prompt;
  turn b-1/b0/b+1  a two-turn conversation whose first turn (prompt + output) ends one token before, exactly
                at, or one token after a block boundary; the second turn is the first + a new question.
                At b0 the first turn's last token (a verify's bonus, or a plain decode's last) completes a
                block before any forward wrote its KV: an engine that registers that block serves the next
                turn a row of a rejected draft's KV or none (the register_before_forward fault);
  short         two prompts sharing all but the last token of a block: the match must stop one block short.
The block size is the engine's (the local engine says it); for an endpoint `block_sizes` is a sweep of
candidates (vLLM's default 16; SGLang's radix cache matches per token, so any size exercises it).
Per case the report says whether the warm continuation drafted, or fell back: no drafts (or the engine's own
`capture_fallback` flag) where the cold run of the same request drafted: a prefix hit whose drafter context
was not restored, e.g. the no_publish_on_finish fault; from per-request spec stats, else from the engine's
counter deltas. Speculation silently off is a defect: a fallback fails its case ("warm turn fell back"),
unless the engine's configuration turns capture reuse off (describe()'s `capture_blocks` 0, the local
engine's `spec_capture_cache_mb=0`: every warm turn falls back by design; counted and named, not failed). Warm and cold must also speculate alike where both draft:
over the cases whose warm and cold mean accepted lengths differ, a two-sided exact sign test
(`scipy.stats.binomtest`, p 0.5) at `accept_alpha` fails the gate when the warm turns accept less (or
more) than their cold twins in too many of them (`acceptance` in the outcome: cases compared, fewer, more, p);
an fp32 engine whose warm and cold runs are the same computation differs in none.
Verdict: FAIL when any case fails (or a request fails) or the sign test rejects; CANNOT TEST without a cold
path, token ids or logprobs; PASS otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, counters_delta
from specbench.harness.adapters.prom import parse_prometheus
from specbench.harness.verdicts import CANNOT_TEST, EXIT_OK, FAIL, PASS, CannotTest, exit_code

from .greedy import GreedyGateOptions, engine_dtype, resolve_rule
from .outcomes import NO_OUTPUT
from .regret import MARGIN_TOL, STRICT_FP32_TOL, first_divergence, judge_pick, merged_dist

FP32_DRIFT_FLOOR = 1e-3  # nat: 25x the largest fp32 noise between correct paths (regret.py STRICT_FP32_TOL / 10)
HALF_DRIFT_FLOOR = 0.10  # nat: above the 0.04 warm-vs-cold spread of correct turns in bf16 (issue #21's seed data)
SYSTEM_PROMPT = ("You are a careful assistant. Read the question, reason step by step, show each calculation, "
                 "check the arithmetic once more, and give the final answer as a number on its own line. "
                 "Keep the explanation short and never skip a step.\n\n")
FOLLOW_UP = "\nQuestion: And what is that amount divided by two?\nAnswer:"
BOUNDARIES = (-1, 0, 1)


@dataclass(frozen=True)
class PrefixGateOptions:
    block_sizes: tuple[int, ...] | None = None  # None: the engine's page size (local), else (16,)
    top_k: int = 5  # first-token logprobs compared
    max_tokens: int = 16  # warm / cold continuation tokens (the regret rule's span)
    first_turn_tokens: int = 24  # at least this many tokens in a first turn
    noise_factor: float = 4.0
    accept_alpha: float = 0.01  # the warm-vs-cold acceptance sign test's level
    drift_floor: float | None = None  # None: by dtype (FP32_DRIFT_FLOOR or HALF_DRIFT_FLOOR)
    greedy: GreedyGateOptions = field(default_factory=GreedyGateOptions)


@dataclass
class Case:
    conversation: str
    kind: str  # repeat | system | turn | short
    block: int
    boundary: int | None  # turn: the first turn's end relative to a block boundary (-1, 0, +1)
    warmup: list[int]  # token ids of the warm-up request (turn: the first turn's prompt)
    warmup_tokens: int  # its max_tokens
    warm: list[int] | None = None  # the warm request's ids (turn: built from the first turn's output)
    # outcome
    cached_tokens: int | None = None
    drift: float | None = None
    noise: float | None = None
    regret: dict | None = None
    drafted: str = "?"  # drafted | fell back | no drafts (cold neither) | ?
    warm_accept: float | None = None
    cold_accept: float | None = None
    compared: int = 0  # warm and cold continuation tokens compared (the shorter's length)
    warm_drafts: int | None = None  # the warm continuation's verify steps with drafts, and their accepted tokens
    warm_accepted: int | None = None
    accept_source: str | None = None  # where they came from: "per-request" | "counters" | None (not reported)
    ok: bool = True
    reason: str = ""

    @property
    def name(self) -> str:
        where = f"boundary {self.boundary:+d}" if self.boundary is not None else self.kind
        return f"{self.conversation} / {self.kind} / block {self.block} / {where}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["name"] = self.name
        return d


@dataclass
class PrefixOutcome:
    engine: dict
    cold_method: str
    tolerance: float
    noise: float
    floor: float
    rule: dict
    cases: list[Case]
    verdict: str = PASS
    reason: str = ""
    acceptance: dict = field(default_factory=dict)  # the warm-vs-cold sign test (module docstring)
    fallback_by_config: bool = False  # the engine's configuration turns capture reuse off

    @property
    def failed(self) -> list[Case]:
        return [c for c in self.cases if not c.ok]

    @property
    def fallbacks(self) -> list[Case]:
        return [c for c in self.cases if c.drafted == "fell back"]

    @property
    def ok(self) -> bool:
        return exit_code(self.verdict) == EXIT_OK

    @classmethod
    def from_records(cls, summary: dict, cases: Sequence[dict]) -> PrefixOutcome:
        """The outcome again from what a results run holds (run.json's summary: `to_dict` less the cases; one
        `cases` record per case), so `specbench report` renders it with `render_markdown` like the run did."""
        known = {f.name for f in fields(Case)}
        out = cls(summary.get("engine") or {}, summary.get("cold_method") or "", float(summary.get("tolerance") or 0),
                  float(summary.get("noise") or 0), float(summary.get("floor") or 0), summary.get("rule") or {},
                  [Case(**{k: v for k, v in c.items() if k in known}) for c in cases],
                  verdict=summary.get("verdict") or "", reason=summary.get("reason") or "",
                  acceptance=summary.get("acceptance") or {},
                  fallback_by_config=bool(summary.get("fallback_by_config")))
        return out

    def to_dict(self) -> dict:
        return {"suite": "lossless-prefix", "verdict": self.verdict, "reason": self.reason, "engine": self.engine,
                "cold_method": self.cold_method, "tolerance": self.tolerance, "noise": self.noise,
                "floor": self.floor, "rule": self.rule, "failed": [c.name for c in self.failed],
                "fallbacks": [c.name for c in self.fallbacks], "fallback_by_config": self.fallback_by_config,
                "acceptance": self.acceptance, "cases": [c.to_dict() for c in self.cases]}


def engine_block(adapter: EngineAdapter) -> int | None:
    cfg = (adapter.describe() or {}).get("config")
    v = cfg.get("page_size") if isinstance(cfg, dict) else None
    return int(v) if isinstance(v, int) and v > 0 else None


def capture_reuse_off(adapter: EngineAdapter) -> bool:
    """The engine's configuration turns the drafter's capture reuse off (every warm hit falls back by design)."""
    cfg = (adapter.describe() or {}).get("config")
    return isinstance(cfg, dict) and cfg.get("capture_blocks") == 0


def acceptance_sign_test(cases: Sequence[Case], alpha: float) -> dict:
    """Warm against cold mean accepted length over the cases where both drafted: a two-sided exact sign test
    over those that differ (ties carry no sign). `ok` False when it rejects at `alpha`."""
    pairs = [(c.warm_accept, c.cold_accept) for c in cases if c.warm_accept is not None and c.cold_accept is not None]
    fewer = sum(1 for w, k in pairs if w < k)
    more = sum(1 for w, k in pairs if w > k)
    p = 1.0
    if fewer + more:
        from scipy.stats import binomtest

        p = float(binomtest(fewer, fewer + more, 0.5, alternative="two-sided").pvalue)
    return {"compared": len(pairs), "fewer": fewer, "more": more, "p": p, "alpha": alpha, "ok": p > alpha}


def first_turn_tokens(prompt_len: int, block: int, boundary: int, at_least: int) -> int:
    """max_tokens that make prompt + output end `boundary` tokens past a multiple of `block`."""
    total = prompt_len + at_least
    n = -(-(total - boundary) // block)
    return n * block + boundary - prompt_len


def build_cases(conversations: Sequence[tuple[str, list[int]]], system: list[int], block: int,
                opts: PrefixGateOptions) -> list[Case]:
    """The cases of one block size (module docstring) over the conversations' first prompts."""
    cases: list[Case] = []
    for i, (cid, ids) in enumerate(conversations):
        nxt = conversations[(i + 1) % len(conversations)][1]
        # The turns first, boundary 0 first: a later case of this conversation computes the same greedy tokens,
        # and the KV it leaves in freed pages would be the right KV for a block registered a row early (an
        # engine reuses freed pages in the same order), hiding the register-before-forward defect.
        for b in sorted(BOUNDARIES, key=abs):
            m = first_turn_tokens(len(ids), block, b, opts.first_turn_tokens)
            cases.append(Case(cid, "turn", block, b, list(ids), m))
        cases.append(Case(cid, "repeat", block, None, list(ids), opts.max_tokens, warm=list(ids)))
        cases.append(Case(cid, "system", block, None, system + list(nxt), opts.max_tokens, warm=system + list(ids)))
        shared = (system + list(ids))[: max(block, (len(system) // block) * block) - 1]  # ends 1 short of a block
        tail_a, tail_b = list(nxt[:8]) or [1], list(ids[:8]) or [2]
        if tail_a[0] == tail_b[0]:
            tail_b = [tail_b[0] + 1] + tail_b[1:]
        cases.append(Case(cid, "short", block, None, shared + tail_a, opts.max_tokens, warm=shared + tail_b))
    return cases


async def _one(adapter: EngineAdapter, req: GenRequest) -> GenResult:
    res = (await adapter.generate([req], concurrency=1))[0]
    if not res.ok:
        raise _RequestFailed(f"{req.rid}: {res.error}")
    return res


class _RequestFailed(Exception):
    pass


def _first_dist(res: GenResult) -> dict[int, float]:
    if not res.logprobs:
        return {}
    p = res.logprobs[0]
    return merged_dist(p.top, p.token_id, p.logprob)


def drift_of(a: dict[int, float], b: dict[int, float]) -> float | None:
    """The largest logprob difference over the tokens both report (None: nothing in common)."""
    common = [t for t in a if t in b]
    if not common:
        return None
    return max(abs(a[t] - b[t]) for t in common)


HIT_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")  # vLLM's, in tokens (specbench too)


def prefix_hits(text: str | None) -> float | None:
    """The prefix-cache hit counter (tokens) in a /metrics text, summed over labels; None when absent."""
    if not text:
        return None
    vals = [v for name, _, v in parse_prometheus(text) if name in HIT_COUNTERS]
    return sum(vals) if vals else None


def _accept(res: GenResult, delta: dict | None) -> tuple[int | None, int | None, str | None]:
    """(drafts, accepted, source) of one request: its own spec stats ("per-request"), else the counters' delta
    around it ("counters")."""
    s = res.spec or {}
    if s.get("num_drafts") is not None:
        return int(s["num_drafts"]), int(s.get("num_accepted_tokens") or 0), "per-request"
    if delta is not None and delta.get("num_drafts") is not None:
        return int(delta["num_drafts"]), int(delta.get("num_accepted_tokens") or 0), "counters"
    return None, None, None


class _Gate:
    def __init__(self, adapter: EngineAdapter, opts: PrefixGateOptions, cold_method: str, margin: float) -> None:
        self.ad, self.opts, self.cold_method, self.margin = adapter, opts, cold_method, margin
        self.n = 0

    def req(self, ids: list[int], max_tokens: int, cold: bool = False, logprobs: int | None = None,
            ignore_eos: bool = True) -> GenRequest:
        self.n += 1
        return GenRequest(prompt=list(ids), max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                          logprobs=logprobs, rid=f"prefix-{self.n}",
                          prompt_cache=False if cold and self.cold_method == "salt" else None)

    async def cold(self, ids: list[int], max_tokens: int, logprobs: int | None = None) -> GenResult:
        if self.cold_method == "reset" and await self.ad.reset_prefix_cache() is not True:
            raise CannotTest("prefix_reset", "the engine refused to flush its prefix cache between cold runs")
        return await _one(self.ad, self.req(ids, max_tokens, cold=True, logprobs=logprobs))

    async def spec_run(self, ids: list[int], cold: bool) -> tuple[GenResult, int | None, int | None, str | None]:
        before = await self.ad.spec_counters()
        res = await (self.cold(ids, self.opts.max_tokens) if cold else _one(self.ad, self.req(ids, self.opts.max_tokens)))
        return (res, *_accept(res, counters_delta(before, await self.ad.spec_counters())))

    async def run_case(self, c: Case) -> None:
        o = self.opts
        if self.cold_method == "reset":
            await self.ad.reset_prefix_cache()
        first = await _one(self.ad, self.req(c.warmup, c.warmup_tokens))
        if first.output_ids is None:
            raise CannotTest("output_ids", "the engine reports no output token ids; the gate builds turns from them")
        if not first.output_ids and not first.text:
            raise CannotTest("output", NO_OUTPUT)  # an engine that yields nothing: the one true reason
        if c.kind == "turn":
            total = len(c.warmup) + len(first.output_ids)
            c.boundary = total - round(total / c.block) * c.block  # as it ended (an early EOS moves it)
            c.warm = c.warmup + list(first.output_ids) + self.follow_up
        assert c.warm is not None
        h0 = prefix_hits(await self.ad.metrics_text())
        warm, wd, wa, c.accept_source = await self.spec_run(c.warm, cold=False)
        h1 = prefix_hits(await self.ad.metrics_text())
        wlp = await _one(self.ad, self.req(c.warm, 1, logprobs=o.top_k))
        c.cached_tokens = (warm.spec or {}).get("cached_tokens")
        if c.cached_tokens is None and h0 is not None and h1 is not None:
            c.cached_tokens = int(h1 - h0)  # the counters' delta around the warm request (other traffic adds)
        cold1 = await self.cold(c.warm, 1, logprobs=o.top_k)
        cold2 = await self.cold(c.warm, 1, logprobs=o.top_k)
        cold, cd, ca, _ = await self.spec_run(c.warm, cold=True)
        c.warm_drafts, c.warm_accepted = wd, wa
        dw, d1, d2 = _first_dist(wlp), _first_dist(cold1), _first_dist(cold2)
        if not dw or not d1 or not d2:
            raise CannotTest("logprobs", "the engine returned no first-token logprobs")
        c.drift, c.noise = drift_of(dw, d1), drift_of(d1, d2)
        c.warm_accept = None if not wd else 1.0 + (wa or 0) / wd
        c.cold_accept = None if not cd else 1.0 + (ca or 0) / cd
        if (warm.spec or {}).get("capture_fallback") is True and cd:
            c.drafted = "fell back"  # the engine says so: its prefix hit came without the drafter's context
        elif wd is None:
            c.drafted = "?"
        elif wd:
            c.drafted = "drafted"
        elif cd:
            c.drafted = "fell back"
        else:
            c.drafted = "no drafts"
        wi, ci = list(warm.output_ids or []), list(cold.output_ids or [])
        c.compared = min(len(wi), len(ci))
        pos = first_divergence(wi, ci)
        if pos is not None and pos < min(len(wi), len(ci)):
            ref = await self.cold(c.warm + ci[:pos], 1, logprobs=max(o.top_k, 20))
            j = judge_pick(wi[pos], _first_dist(ref), self.margin)
            c.regret = {"position": pos, **j.to_dict()}
            if not j.ok:
                c.ok, c.reason = False, f"warm continuation diverges at {pos}: {j.describe()}"
        elif pos is not None:
            c.ok, c.reason = False, f"warm and cold continuations differ in length ({len(wi)} vs {len(ci)})"

    follow_up: list[int] = []


async def run_prefix_gate(adapter: EngineAdapter, conversations: Sequence[tuple[str, list[int]]],
                          opts: PrefixGateOptions | None = None, log: Callable[[str], None] | None = None,
                          on_case: Callable[[Case], None] | None = None) -> PrefixOutcome:
    """The gate over `conversations` ((id, first-prompt token ids), at least one)."""
    opts = opts or PrefixGateOptions()
    say = log or (lambda s: None)
    greedy = resolve_rule(opts.greedy, adapter, adapter)
    margin = greedy.tol
    dtype = engine_dtype(adapter)
    floor = opts.drift_floor if opts.drift_floor is not None else \
        (FP32_DRIFT_FLOOR if dtype in ("float32", "fp32") else HALF_DRIFT_FLOOR)
    out = PrefixOutcome(adapter.describe(), "", 0.0, 0.0, floor, {"rule": greedy.rule, "tol": margin,
                                                                 "why": greedy.rule_reason}, [])
    reset = await adapter.reset_prefix_cache()
    if reset is True:
        out.cold_method = "reset"
    elif adapter.cold_requests():
        out.cold_method = "salt"
    else:
        out.verdict = f"{CANNOT_TEST} (prefix_reset)"
        out.reason = ("the engine can neither flush its prefix cache (no reset route, or it refused) nor keep a "
                      "request off it (no cache salt): nothing cold to compare a warm request with")
        return out
    if not conversations:
        out.verdict, out.reason = f"{CANNOT_TEST} (prompts)", "no conversations to run"
        return out
    eb = engine_block(adapter)
    blocks = opts.block_sizes or ((eb,) if eb else (16,))
    sys_ids = await adapter.tokenize(SYSTEM_PROMPT)
    follow = await adapter.tokenize(FOLLOW_UP)
    if not sys_ids or not follow:
        out.verdict, out.reason = f"{CANNOT_TEST} (tokenize)", "the engine gives no token ids for the gate's text"
        return out
    gate = _Gate(adapter, opts, out.cold_method, margin)
    gate.follow_up = list(follow)
    try:
        for b in blocks:
            for c in build_cases(conversations, list(sys_ids), b, opts):
                try:
                    await gate.run_case(c)
                except _RequestFailed as e:
                    c.ok, c.reason = False, f"request failed: {e}"[:300]
                out.cases.append(c)
                if on_case is not None:
                    on_case(c)
    except CannotTest as e:
        out.verdict, out.reason = f"{CANNOT_TEST} ({e.capability})", e.detail
        return out
    noises = [c.noise for c in out.cases if c.noise is not None]
    out.noise = max(noises) if noises else 0.0
    out.tolerance = max(opts.noise_factor * out.noise, floor)
    out.fallback_by_config = capture_reuse_off(adapter)
    for c in out.cases:
        if c.ok and c.drift is not None and c.drift > out.tolerance:
            c.ok, c.reason = False, (f"first-token logprob drift {c.drift:.3g} nat > tolerance {out.tolerance:.3g} "
                                     f"(cold-vs-cold noise {out.noise:.3g})")
        if c.ok and c.drafted == "fell back" and not out.fallback_by_config:
            c.ok, c.reason = False, (f"warm turn fell back: no drafts after its prefix hit ({c.cached_tokens} cached "
                                     f"tokens) where the same request cold drafted (accept {_g(c.cold_accept)}): "
                                     "speculation silently off")
        say(f"[prefix] {c.name}: {'ok' if c.ok else FAIL} drift {_g(c.drift)} cached {c.cached_tokens} "
            f"{c.drafted}{'' if c.ok else ' - ' + c.reason}")
    out.acceptance = acceptance_sign_test(out.cases, opts.accept_alpha)
    acc = out.acceptance
    if out.failed:
        out.verdict = FAIL
        out.reason = f"{len(out.failed)} of {len(out.cases)} cases failed: " + "; ".join(
            f"{c.name}: {c.reason}" for c in out.failed[:3])
    elif not acc["ok"]:
        out.verdict = FAIL
        out.reason = (f"warm turns speculate unlike their cold twins: of {acc['compared']} cases where both drafted, "
                      f"warm accepted less in {acc['fewer']} and more in {acc['more']} (exact sign test p "
                      f"{acc['p']:.2g} <= {acc['alpha']:g}); the tokens themselves were lossless")
    elif not any(c.drift is not None for c in out.cases):
        out.verdict, out.reason = f"{CANNOT_TEST} (logprobs)", "no case had first-token logprobs in common"
    elif any(c.cached_tokens is not None for c in out.cases) and not any(c.cached_tokens for c in out.cases):
        out.verdict = f"{CANNOT_TEST} (prefix cache)"
        out.reason = ("no warm request was served from the prefix cache (0 cached tokens in every case): the engine's "
                      "cache is off or never matched, so warm and cold were the same computation")
    elif all(c.cached_tokens is None for c in out.cases):
        out.verdict = f"{PASS} (cache hits unverified)"
        out.reason = (f"{len(out.cases)} cases, drift within {out.tolerance:.3g} nat, but the engine reports no "
                      "cached-token counts (per request or vllm:prefix_cache_hits): a warm hit is not shown")
    else:
        out.verdict = PASS
        out.reason = f"{len(out.cases)} cases, drift within {out.tolerance:.3g} nat; " + (
            f"{len(out.fallbacks)} fell back (capture reuse off by the engine's configuration)"
            if out.fallback_by_config else "no warm turn fell back")
    return out


@dataclass
class PrefixSelftest:
    clean: list[PrefixOutcome]
    faults: dict[str, PrefixOutcome]
    # per fault, what the engine says the self-test expects of it (its "faults" capability, `fault_catalogue`):
    # "fail" (the verdict is FAIL) or "fallback" (the tokens stay lossless; some warm turn falls back where the
    # clean run drafts, which fails the gate too)
    expect: dict[str, str] = field(default_factory=dict)

    def problems(self) -> list[str]:
        out = []
        for i, c in enumerate(self.clean, 1):
            if not c.ok or c.fallbacks:
                out.append(f"clean #{i}: {c.verdict}, {len(c.fallbacks)} fell back ({c.reason[:120]})")
        for name, o in self.faults.items():
            want = self.expect.get(name, "fail")
            if want == "fail" and o.verdict != FAIL:
                out.append(f"{name}: {o.verdict}, expected FAIL")
            if want == "fallback" and (not o.fallbacks or o.verdict != FAIL):
                out.append(f"{name}: {len(o.fallbacks)} warm turns fell back, {o.verdict} (expected fallbacks, FAIL)")
        return out

    @property
    def ok(self) -> bool:
        return bool(self.clean) and not self.problems()

    def to_dict(self) -> dict:
        return {"suite": "lossless-prefix-selftest", "ok": self.ok, "problems": self.problems(),
                "clean": [c.to_dict() for c in self.clean], "faults": {k: v.to_dict() for k, v in self.faults.items()}}


async def run_prefix_selftest(adapter: EngineAdapter, conversations: Sequence[tuple[str, list[int]]],
                              opts: PrefixGateOptions | None = None, repeat: int = 5,
                              log: Callable[[str], None] | None = None) -> PrefixSelftest:
    """The gate on `repeat` fresh clean engines (each must PASS with no fallback) and on each prefix fault the
    engine names (its "faults" capability, family "prefix"), held to what the engine says its self-test expects
    (the local engine: register_before_forward must FAIL, no_publish_on_finish must show fallbacks). `adapter` is
    clean run 1; the caller closes it."""
    say = log or (lambda s: None)
    expect = {k: f.expect for k, f in adapter.fault_catalogue().items() if f.family == "prefix"}
    names = list(expect)
    out = PrefixSelftest([], {}, expect)
    for i in range(1, repeat + 1):
        ad = adapter if i == 1 else adapter.with_faults(())
        try:
            o = await run_prefix_gate(ad, conversations, opts)
        finally:
            if ad is not adapter:
                await ad.aclose()
        say(f"[prefix selftest] clean #{i}: {o.verdict}, {len(o.fallbacks)} fell back, worst drift "
            f"{worst_drift(o):.2g}, noise {o.noise:.2g}")
        out.clean.append(o)
    for name in names:
        ad = adapter.with_faults((name,))
        try:
            o = await run_prefix_gate(ad, conversations, opts)
        finally:
            await ad.aclose()
        say(f"[prefix selftest] {name}: {o.verdict}, {len(o.failed)} failed, {len(o.fallbacks)} fell back, "
            f"worst drift {worst_drift(o):.2g}")
        out.faults[name] = o
    return out


def render_selftest(st: PrefixSelftest) -> str:
    lines = [f"# Prefix gate self-test: {PASS if st.ok else FAIL}", "",
             "| engine | verdict | cases failed | fell back | worst drift | tolerance |", "|---|---|---|---|---|---|"]
    rows = [(f"clean #{i}", o) for i, o in enumerate(st.clean, 1)] + list(st.faults.items())
    for label, o in rows:
        lines.append(f"| {label} | {o.verdict} | {len(o.failed)} of {len(o.cases)} | {len(o.fallbacks)} | "
                     f"{worst_drift(o):.2g} | {o.tolerance:.2g} |")
    for name, o in st.faults.items():
        for c in o.failed[:3]:
            lines.append(f"\n- {name}: {c.name}: {c.reason}")
        for c in o.fallbacks[:3]:
            lines.append(f"\n- {name}: {c.name}: warm turn fell back (accept warm {_g(c.warm_accept)}, "
                         f"cold {_g(c.cold_accept)})")
    for p in st.problems():
        lines.append(f"\n- PROBLEM: {p}")
    return "\n".join(lines) + "\n"


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.2g}"


def render_markdown(out: PrefixOutcome) -> str:
    lines = [f"# Prefix gate: {out.verdict}", "", out.reason, "",
             f"- engine: {out.engine.get('name')} ({out.engine.get('kind')}); cold runs by {out.cold_method}",
             f"- first-token drift tolerance {out.tolerance:.3g} nat = max({out.noise:.3g} cold-vs-cold noise x "
             f"factor, floor {out.floor:g}); regret rule {out.rule.get('rule')} ({out.rule.get('tol'):g} nat)",
             f"- fell back (warm turn without drafts where cold drafted): {len(out.fallbacks)} of {len(out.cases)}"
             + (" (capture reuse off by the engine's configuration)" if out.fallback_by_config else ""),
             f"- warm vs cold acceptance (exact sign test over the cases where both drafted): "
             f"{out.acceptance.get('compared', 0)} compared, warm fewer in {out.acceptance.get('fewer', 0)}, more in "
             f"{out.acceptance.get('more', 0)}, p {out.acceptance.get('p', 1.0):.2g}",
             "", "| case | cached | drift | noise | regret | warm turn | accept warm / cold | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in out.cases:
        reg = "-" if c.regret is None else \
            f"{c.regret.get('regret') if c.regret.get('regret') is not None else c.regret.get('lower_bound'):.2g} " \
            f"@{c.regret['position']}"
        acc = f"{_g(c.warm_accept)} / {_g(c.cold_accept)}"
        lines.append(f"| {c.name} | {c.cached_tokens if c.cached_tokens is not None else '?'} | {_g(c.drift)} | "
                     f"{_g(c.noise)} | {reg} | {c.drafted} | {acc} | {'ok' if c.ok else FAIL.because(c.reason)} |")
    return "\n".join(lines) + "\n"


def worst_drift(out: PrefixOutcome) -> float:
    ds = [c.drift for c in out.cases if c.drift is not None and math.isfinite(c.drift)]
    return max(ds) if ds else 0.0


__all__ = ["PrefixGateOptions", "PrefixOutcome", "Case", "run_prefix_gate", "render_markdown", "build_cases",
           "first_turn_tokens", "drift_of", "STRICT_FP32_TOL", "MARGIN_TOL", "worst_drift", "PrefixSelftest",
           "run_prefix_selftest", "render_selftest"]
