"""The greedy losslessness gate: every candidate token checked, with re-anchoring after benign flips.

Contract:
- Baseline = speculation off (any adapter) asked for top-`top_k` logprobs; candidate = speculation on.
  Both get the same token ids (tokenized once, by the baseline), temperature 0, the same max_tokens.
- `check_output` compares one candidate output with baselines: identical -> "identical". At a
  divergence the candidate's pick is judged under the baseline distribution at that position
  (regret.py). A FAIL ends the prompt. A benign flip re-anchors: a fresh baseline is generated from
  prompt + the candidate's tokens up to and including the flip, and the candidate's remaining tokens are
  compared with it, so every later divergence is judged too, up to the end of the output or
  `max_divergences` flips (then `complete` is False and the tokens after the last flip are unchecked).
- Length mismatches: a candidate that keeps going where the baseline stopped (same tokens so far) is a
  FAIL ("past_stop"); one that stops where the baseline continued is a FAIL ("early_stop"). Engines that
  report their EOS token in the output ids (the reference engine) turn an EOS flip into an ordinary token
  divergence instead; for the others an EOS-vs-token tie cannot be scored (docs/lossless.md).
- The tolerance (`resolve_rule`): strict mode when `strict=True`, or when both engines declare fp32
  (describe()["config"]["dtype"]; an openai engine string's `dtype=float32`) and the user typed no margin
  (`margin_given` False): every divergence must cost at most `strict_tol` (regret.STRICT_FP32_TOL, 10x the
  measured fp32 noise between correct paths); else the `margin_tol` (the bf16 / fp16 default, or the one the
  user typed, which is honoured as typed, fp32 or not, and the reason says that strict mode would otherwise
  apply). `GreedyGateOptions.tol` is the one the gate applies; `GateRun.rule` records it (mode, tol, reason).
- Re-scoring (optional): at each divergence the candidate scores prompt + shared prefix + pick through its
  own prefill path (`adapter.score`, echo + logprobs). A benign flip whose pick the candidate's own prefill
  scores more than `tol` below its top-1 is a FAIL ("rescore"): the verify path and the prefill path of one
  engine disagree beyond noise. In strict mode also a FAIL: the candidate's prefill gap between the
  baseline's token and the pick differs from the baseline's by more than `tol` (two fp32 computations of one
  model disagree beyond noise). A pick outside the baseline's top-k is also scored exactly by the baseline
  where it can, reported beside the lower bound.
- `run_greedy` runs a prompt set through both engines and returns a `GateRun` (outcomes.py, re-exported
  here with `Prompt`, `Divergence`, `PromptCheck`) with per-prompt checks, speculation statistics and the
  run checks (checks.py); `GateRun.verdict` is PASS, FAIL, NOT SPECULATING, CANNOT TEST (also where
  nothing shows that the candidate speculated: no counters, no per-request draft counts, no streamed chunk of
  several tokens), or "PASS (speculation asserted by the user, not observed)" there with
  `assume_speculating` (harness/verdicts.py).
- No verdict without evidence (harness/verdicts.py): a prompt whose outputs cannot be compared for want
  of a capability (no output token ids; no usable baseline logprobs at a divergence) is "untestable",
  with the capability named in `missing`; a gate with an untestable prompt, or with no prompt or no token
  compared at all, is CANNOT TEST unless something FAILed. Logprobs the baseline reported as missing or
  fake at a divergence (llama.cpp: tokens accepted from a draft carry none) are never used as a
  distribution: the baseline is asked again for one token from the same prefix (its first token always
  comes from a plain forward pass), then teacher-forced scoring where it has it; the divergence records
  which (`dist_source`). Every gate request sends prompt_cache=False, so a server's prompt cache cannot
  turn one of two identical requests into a different computation.
- Chat prompts (`Prompt.messages`, --endpoint-type chat): the candidate and the first baseline are the same
  chat request (one user message, /v1/chat/completions, the server's own chat template; the baseline also
  asks for top-k logprobs); the rendered prompt is the `prompt_token_ids` the endpoints report
  (`GenResult.prompt_ids`), and two arms that rendered one request to different ids make the prompt
  untestable. What needs token ids after that (re-anchoring after a flip, re-scoring it, recovering a
  missing distribution) sends the rendered ids plus the candidate's tokens, the same token sequence; where
  no endpoint reported the rendered ids, a prompt that needs them is untestable ("prompt token ids (chat
  endpoint)"), never passed. A FAIL the first baseline's own logprobs prove stays a FAIL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from specbench.harness.adapters.base import EngineAdapter, GenRequest, GenResult, PosLogprobs, counters_delta
from specbench.harness.verdicts import CANNOT_TEST, CannotTest

from .checks import (
    acceptance_evidence,
    check_after_stop,
    check_counters,
    check_counts,
    check_kv_idle,
    gate_eos,
    same_tokens_differ,
)
from .outcomes import Divergence, GateRun, Prompt, PromptCheck
from .regret import MARGIN_TOL, STRICT_FP32_TOL, TOP_K, first_divergence, judge_pick, merged_dist

# The outcome records (Divergence, GateRun, Prompt, PromptCheck) live in outcomes.py and stay importable here.
FP32 = frozenset({"float32", "fp32", "torch.float32"})


class LosslessError(ValueError):
    """Bad input to a lossless gate (unusable engines, empty prompt set); the message says what to fix."""


@dataclass(frozen=True)
class GreedyGateOptions:
    margin_tol: float = MARGIN_TOL  # bf16 / fp16 runs
    top_k: int = TOP_K
    max_divergences: int = 8
    rescore: bool = True
    min_accept_len: float = 1.05
    strict: bool | None = None  # None: strict when both engines run fp32 (resolve_rule); True / False: forced
    strict_tol: float = STRICT_FP32_TOL
    rule: str = ""  # set by resolve_rule: "strict" | "margin" ("" = not resolved: the margin applies)
    rule_reason: str = ""
    margin_given: bool = False  # the user typed --margin-tol: honoured as typed, also where both engines run fp32
    assume_speculating: bool = False  # --assume-speculating: no evidence of speculation is PASS_ASSERTED, not CANNOT TEST
    replay: str = ""  # --replay-drafter: the checkpoints the candidate's drafter came from (gates/accept_trace.py)

    @property
    def tol(self) -> float:
        """The regret tolerance the gate applies: strict_tol in strict mode, else margin_tol."""
        return self.strict_tol if self.rule == "strict" else self.margin_tol

    def rule_dict(self) -> dict:
        return {"mode": self.rule or "margin", "tol": self.tol, "reason": self.rule_reason,
                "margin_tol": self.margin_tol, "strict_tol": self.strict_tol, "margin_given": self.margin_given}


def engine_dtype(adapter: EngineAdapter) -> str | None:
    """The dtype an engine declares (describe()["config"]["dtype"]), else None."""
    d = adapter.describe() or {}
    config = d.get("config")
    cfg = config if isinstance(config, dict) else {}
    v = cfg.get("dtype")
    return str(v) if v else None


def resolve_rule(opts: GreedyGateOptions, baseline: EngineAdapter, candidate: EngineAdapter) -> GreedyGateOptions:
    """Options with the tolerance decided: strict (both fp32, or forced) or the margin. Idempotent."""
    if opts.rule:
        return opts
    db, dc = engine_dtype(baseline), engine_dtype(candidate)
    both = db in FP32 and dc in FP32
    dtypes = f"baseline {db or 'dtype unknown'}, candidate {dc or 'dtype unknown'}"
    if opts.strict is True:
        mode, why = "strict", f"--strict ({dtypes})"
    elif opts.strict is False:
        mode, why = "margin", f"--no-strict ({dtypes})"
    elif both and opts.margin_given:
        mode, why = "margin", (f"--margin-tol {opts.margin_tol:g} as typed, although both engines run float32 (strict "
                               "fp32 exactness applies when no --margin-tol is given, or with --strict)")
    elif both:
        mode, why = "strict", "both engines run float32 (no --margin-tol typed)"
    else:
        mode, why = "margin", dtypes + (f": --margin-tol {opts.margin_tol:g} as typed" if opts.margin_given
                                        else ": the bf16 / fp16 margin")
        if db is None or dc is None:
            why += " (an engine that does not declare its dtype: dtype=float32 on its engine string turns strict mode on)"
    return replace(opts, rule=mode, rule_reason=why)


async def _one(adapter: EngineAdapter, req: GenRequest) -> GenResult:
    return (await adapter.generate([req], concurrency=1))[0]


def prompt_request(p: Prompt, max_tokens: int, rid: str | None = None, logprobs: int | None = None) -> GenRequest:
    """The gate's greedy request for one prompt: its chat messages (a chat prompt) or its token ids."""
    if p.chat:
        return GenRequest(messages=[dict(m) for m in p.messages or []], max_tokens=max_tokens, temperature=0.0,
                          logprobs=logprobs, rid=rid, prompt_cache=False)
    return GenRequest(prompt=list(p.ids), max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, rid=rid,
                      prompt_cache=False)


NO_CHAT_IDS = "prompt token ids (chat endpoint)"


def rendered_prompt(base: GenResult, cand: GenResult) -> tuple[list[int] | None, str | None]:
    """The rendered prompt of one chat request from what both arms reported: (ids or None, problem or None).
    A problem: the arms rendered the same request to different prompts (ids, else usage prompt_tokens)."""
    b, c = base.prompt_ids, cand.prompt_ids
    if b is not None and c is not None and b != c:
        i = first_divergence(b, c)
        return None, (f"the same chat request was rendered to different prompt token ids (baseline {len(b)}, "
                      f"candidate {len(c)} tokens, first difference at {i}): not the same computation")
    ids = b if b is not None else c
    nb = len(b) if b is not None else base.prompt_tokens
    nc = len(c) if c is not None else cand.prompt_tokens
    if nb is not None and nc is not None and nb != nc:
        return None, (f"the same chat request was rendered to prompts of different lengths (baseline {nb}, "
                      f"candidate {nc} tokens): not the same computation")
    return (list(ids) if ids else None), None


async def baseline_for(baseline: EngineAdapter, prompt_ids: list[int], prefix: list[int], max_tokens: int,
                       top_k: int, stop: tuple[str, ...] = ()) -> GenResult:
    return await _one(baseline, GenRequest(prompt=list(prompt_ids) + list(prefix), max_tokens=max_tokens,
                                           temperature=0.0, logprobs=top_k, stop=stop, prompt_cache=False))


def position_dist(lps: Sequence[PosLogprobs] | None, i: int) -> dict[int, float]:
    """The reported distribution at output position i; {} where it is missing or fake (no logprob, no top-k)."""
    if lps is None or i >= len(lps):
        return {}
    p = lps[i]
    if p.logprob is None and not p.top:
        return {}
    return merged_dist(p.top, p.token_id, p.logprob)


async def recover_dist(baseline: EngineAdapter, ids_before: list[int], pick: int, top_k: int) -> tuple[dict, str, str]:
    """A real baseline distribution at the position after `ids_before` when the generation's was missing:
    one fresh greedy token from that prefix (position 0 of a generation comes from a plain forward pass,
    never from a draft), else teacher-forced scoring. Returns (dist, source, note); dist {} if neither."""
    one = await baseline_for(baseline, ids_before, [], 1, top_k)
    d = position_dist(one.logprobs, 0) if one.ok else {}
    if d:
        return d, "regenerated", "baseline logprobs missing at this position in its generation: re-generated one " \
            "token from the same prefix for them"
    got, note = await _score(baseline, ids_before, pick, top_k)
    if got is not None and got["dist"]:
        return got["dist"], "teacher-forced", "baseline logprobs missing at this position: teacher-forced scoring"
    return {}, "none", f"baseline logprobs missing at this position; a one-token re-generation gave none and " \
        f"teacher-forced scoring: {note}"


async def _score(adapter: EngineAdapter | None, ids: list[int], pick: int, top_k: int) -> tuple[dict | None, str]:
    """(dist incl. pick, note) from teacher-forced scoring, or (None, why not)."""
    if adapter is None:
        return None, "off"
    try:
        sc = await adapter.score(ids, [pick], top_k=top_k)
    except Exception as e:  # a scoring failure is reported, never fatal
        return None, f"error: {type(e).__name__}: {e}"
    if sc is None or not sc.positions:
        return None, "unsupported by this engine"
    p = sc.positions[0]
    return {"dist": merged_dist(p.top, p.token_id, p.logprob), "pick_logprob": p.logprob}, "ok"


async def _rescore(candidate: EngineAdapter | None, ids: list[int], pick: int, baseline_token: int | None,
                   top_k: int) -> dict:
    got, note = await _score(candidate, ids, pick, top_k)
    if got is None:
        return {"status": note}
    dist, lp = got["dist"], got["pick_logprob"]
    top1, lp1 = min(dist.items(), key=lambda kv: (-kv[1], kv[0]))
    return {"status": "ok", "pick_logprob": lp, "top1": top1, "top1_logprob": lp1,
            "regret": None if lp is None else max(0.0, lp1 - lp),
            "baseline_token_logprob": dist.get(baseline_token) if baseline_token is not None else None,
            "agrees_with_pick": top1 == pick}


def rescore_disagreement(d: Divergence, opts: GreedyGateOptions) -> str | None:
    """Why the candidate's own re-scoring of a benign flip fails it (None when it agrees within `opts.tol`):
    its prefill ranks the pick more than tol below its top-1 (verify and prefill of one engine disagree), or,
    in strict mode, its prefill gap between the baseline's token and the pick differs from the baseline's by
    more than tol (two fp32 computations of one model disagree)."""
    rs, j, tol = d.rescore or {}, d.judgement, opts.tol
    if rs.get("status") != "ok" or j is None:
        return None
    r = rs.get("regret")
    if r is not None and r > tol + 1e-9:
        return (f"the candidate's own prefill scores its pick {d.pick} {r:.3g} nat below its top-1 {rs.get('top1')} "
                f"(> {tol:g}): its verify path and its prefill path disagree beyond noise")
    lp_bt, lp_pick = rs.get("baseline_token_logprob"), rs.get("pick_logprob")
    if opts.rule == "strict" and j.regret is not None and j.top1 == d.baseline_token and lp_bt is not None \
            and lp_pick is not None:
        diff = abs((lp_bt - lp_pick) - j.regret)
        if diff > tol + 1e-9:
            return (f"the candidate's prefill puts token {d.baseline_token} {lp_bt - lp_pick:.3g} nat above the pick, "
                    f"the baseline {j.regret:.3g} nat: they differ by {diff:.3g} > {tol:g} (fp32 computations of one "
                    "model disagree beyond noise)")
    return None


def same_engine_kind(a: EngineAdapter, b: EngineAdapter) -> bool:
    """Both arms the same kind of engine (adapter kind, and the endpoint dialect where probed): then equal ids
    must mean equal text and finish reason (`same_tokens_differ`); across kinds detokenizer conventions may
    differ (special tokens, clean-up of spaces)."""
    da, db = a.describe() or {}, b.describe() or {}
    if da.get("kind") != db.get("kind"):
        return False
    ca, cb = da.get("capabilities") or {}, db.get("capabilities") or {}
    return not isinstance(ca, dict) or not isinstance(cb, dict) or ca.get("dialect") == cb.get("dialect")


async def check_output(baseline: EngineAdapter, prompt: Prompt, cand: GenResult, max_tokens: int,
                       opts: GreedyGateOptions, candidate: EngineAdapter | None = None,
                       first_base: GenResult | None = None, compare_text: bool = False) -> PromptCheck:
    """Judge one candidate output against baselines, re-anchoring after each benign flip. compare_text: where
    the whole output equals the first baseline's, its text and finish reason must equal the baseline's too."""
    pc = PromptCheck(prompt.pid, len(prompt.ids), max_tokens, spec=cand.spec)
    if not cand.ok:
        pc.status, pc.reason, pc.complete = "error", f"candidate request failed: {cand.error}", False
        return pc
    if cand.output_ids is None:
        pc.status, pc.complete, pc.missing = "untestable", False, "output token ids (candidate)"
        pc.reason = f"{CANNOT_TEST}: the candidate reports no output token ids (re-tokenized text is no substitute)"
        return pc
    if cand.text and not cand.output_ids:
        pc.status, pc.complete, pc.missing = "untestable", False, "output token ids (candidate)"
        pc.reason = f"{CANNOT_TEST}: the candidate returned text ({cand.text[:30]!r}) but an empty token list"
        return pc
    out = list(cand.output_ids)
    pc.candidate_tokens = len(out)
    anchor = 0
    no_ids = prompt.chat and not prompt.ids  # a chat prompt whose rendered ids no endpoint reported

    def needs_ids(pos: int, what: str) -> PromptCheck:
        pc.status, pc.complete, pc.missing = "untestable", False, NO_CHAT_IDS
        pc.reason = (f"{CANNOT_TEST} at position {pos}: {what} needs the rendered prompt's token ids, which the "
                     "chat endpoint did not report (vLLM's return_token_ids gives prompt_token_ids)")
        return pc

    if first_base is None and prompt.chat:
        raise LosslessError("check_output: a chat prompt needs its first baseline (the same chat request)")
    base = first_base or await baseline_for(baseline, prompt.ids, [], max_tokens, opts.top_k)
    while True:
        if not base.ok:
            pc.status, pc.complete = "error", False
            pc.reason = f"baseline request failed (anchor {anchor}): {base.error}"
            return pc
        if base.output_ids is None or (base.text and not base.output_ids):
            pc.status, pc.complete, pc.missing = "untestable", False, "output token ids (baseline)"
            pc.reason = f"{CANNOT_TEST}: the baseline reports no output token ids (anchor {anchor})"
            return pc
        rest, bids = out[anchor:], list(base.output_ids)
        i = first_divergence(rest, bids)
        if i is None:
            pc.tokens_compared = len(out)
            bad = same_tokens_differ(cand, base) if compare_text and anchor == 0 else None
            if bad:
                pc.status, pc.reason = "fail", bad
            return pc
        pos = anchor + i
        pc.tokens_compared = pos + 1 if i < len(rest) else pos
        if i >= len(bids):  # the baseline stopped here, the candidate did not
            pc.divergences.append(Divergence(pos, "past_stop", rest[i], None, anchor))
            pc.status, pc.reason = "fail", pc.divergences[-1].describe()
            return pc
        if i >= len(rest):
            why = cand.finish_reason or "?"
            pc.divergences.append(Divergence(pos, "early_stop", None, bids[i], anchor))
            pc.status, pc.reason = "fail", pc.divergences[-1].describe() + f" (finish_reason={why})"
            return pc
        pick, bt = rest[i], bids[i]
        dist = position_dist(base.logprobs, i)
        ids_before = list(prompt.ids) + out[:pos]
        source, note = "generation", ""
        if not dist and no_ids:
            pc.divergences.append(Divergence(pos, "token", pick, bt, anchor, None, dist_source="none"))
            pc.status, pc.complete = "untestable", False
            pc.missing = "baseline logprobs at the divergence (chat endpoint)"
            pc.reason = (f"{CANNOT_TEST} at position {pos} (pick {pick} vs baseline {bt}): the baseline's chat answer "
                         "has no logprobs there, and without the rendered prompt's token ids (prompt_token_ids) "
                         "they cannot be recovered by a token-id request")
            return pc
        if not dist:
            dist, source, note = await recover_dist(baseline, ids_before, pick, opts.top_k)
            if not dist:
                pc.divergences.append(Divergence(pos, "token", pick, bt, anchor, None, dist_source="none"))
                pc.status, pc.complete, pc.missing = "untestable", False, "baseline logprobs at the divergence"
                pc.reason = f"{CANNOT_TEST} at position {pos} (pick {pick} vs baseline {bt}): {note}"
                return pc
        j = judge_pick(pick, dist, opts.tol)
        if j.kind == "outside_topk" and not no_ids:
            got, _ = await _score(baseline, ids_before, pick, opts.top_k)
            if got is not None and got["pick_logprob"] is not None:
                j = judge_pick(pick, dist, opts.tol, exact_pick_logprob=got["pick_logprob"])
        d = Divergence(pos, "token", pick, bt, anchor, j, dist_source=source)
        if note and not pc.reason:
            pc.reason = note
        if opts.rescore and no_ids:
            d.rescore = {"status": f"no {NO_CHAT_IDS}"}
            if j.ok:  # a benign flip the candidate's own prefill cannot re-score: not judged
                pc.divergences.append(d)
                return needs_ids(pos, "re-scoring the flip with the candidate's own prefill")
        elif opts.rescore:
            d.rescore = await _rescore(candidate, ids_before, pick, bt, opts.top_k)
            if j.ok:
                d.rescore_fail = rescore_disagreement(d, opts)
        pc.divergences.append(d)
        if not d.ok:
            pc.status, pc.reason = "fail", d.describe()
            return pc
        pc.status = "flip"
        anchor = pos + 1
        if anchor >= len(out):
            pc.tokens_compared = len(out)
            return pc
        if len(pc.divergences) >= opts.max_divergences:
            pc.complete = False
            pc.reason = (f"stopped after {len(pc.divergences)} benign flips (--max-divergences); "
                         f"tokens {anchor}..{len(out) - 1} unchecked")
            return pc
        if no_ids:
            return needs_ids(anchor, f"re-anchoring after the benign flip at position {pos}")
        pc.reanchors += 1
        base = await baseline_for(baseline, prompt.ids, out[:anchor], max_tokens - anchor, opts.top_k)


async def tokenize_prompts(baseline: EngineAdapter, candidate: EngineAdapter,
                           texts: Sequence[tuple[str, str]]) -> tuple[list[Prompt], list[str]]:
    """Token ids from the baseline's tokenizer (else the candidate's); notes when the two disagree.

    An empty token list for a non-empty text is an error, never a prompt. Raises CannotTest("tokenize")
    when neither engine gives ids for a prompt."""
    notes: list[str] = []
    prompts: list[Prompt] = []
    for pid, text in texts:
        ids = _usable(await baseline.tokenize(text), text)
        cids = _usable(await candidate.tokenize(text), text)
        if ids is None:
            ids = cids
        elif cids is not None and cids != ids and not notes:
            notes.append("the engines tokenize differently; both get the baseline's token ids")
        if ids is None:
            raise CannotTest("tokenize", "neither engine gives token ids for the prompts (no /tokenize, or an "
                             "empty token list for a non-empty text); the gate needs the same ids on both sides "
                             "and for re-anchoring: give --tokenizer DIR (the model's tokenizer.json) or a "
                             "baseline that tokenizes")
        prompts.append(Prompt(pid, list(ids), text))
    return prompts, notes


def _usable(ids: list[int] | None, text: str) -> list[int] | None:
    return None if ids is None or (text and not ids) else list(ids)


def cannot_compare(pc: PromptCheck, sides: Sequence[tuple[str, GenResult]]) -> bool:
    """Whether two outputs cannot be compared token by token, `pc` marked with why: "error" when a side's request
    failed, "untestable" (CANNOT TEST) when a side reports no output token ids, or text with an empty token list
    (re-tokenized text is no substitute). False, `pc` untouched, when every side can be compared."""
    for side, r in sides:
        if not r.ok:
            pc.status, pc.complete, pc.reason = "error", False, f"the {side} request failed: {r.error}"
            return True
        if _usable(r.output_ids, r.text) is None:
            pc.status, pc.complete, pc.missing = "untestable", False, f"output token ids ({side})"
            pc.reason = f"{CANNOT_TEST}: the {side} request reports no output token ids"
            return True
    return False


async def health(adapter: EngineAdapter, settle_s: float = 2.0) -> dict | None:
    """The adapter's health snapshot once idle (None where it has none); waits briefly for the loop to settle."""
    fn: Callable | None = getattr(adapter, "health", None)
    if fn is None:
        return None
    t_end = time.perf_counter() + settle_s
    while True:
        h = await fn()
        if h is None or not ((h.get("running") or 0) + (h.get("waiting") or 0)) or time.perf_counter() > t_end:
            return h
        await asyncio.sleep(0.02)


async def finish_run(name: str, candidate: EngineAdapter, baseline: EngineAdapter, prompts: list[PromptCheck],
                     results: Sequence[GenResult], delta: dict | None, opts: GreedyGateOptions, t0: float,
                     k: int | None = None, max_tokens: Sequence[int] | None = None) -> GateRun:
    """Spec statistics and the run checks (counters, after-EOS, output counts, KV idle) around one gate's
    requests (`max_tokens`: each result's, in order, where known)."""
    stats = acceptance_evidence(results, delta, opts.min_accept_len, assumed=opts.assume_speculating)
    eos = gate_eos(baseline, candidate)
    checks = [check_counters(stats, k), check_after_stop(results, eos), check_counts(results, max_tokens),
              check_kv_idle(await health(candidate))]
    return GateRun(name, prompts, stats, checks, time.perf_counter() - t0, results=list(results),
                   rule=opts.rule_dict(), delta=delta)


def engine_k(adapter: EngineAdapter) -> int | None:
    cfg = (adapter.describe() or {}).get("config") or {}
    k = cfg.get("k") if isinstance(cfg, dict) else None
    return int(k) if isinstance(k, int) and k > 0 else None


async def run_greedy(baseline: EngineAdapter, candidate: EngineAdapter, prompts: Sequence[Prompt], max_tokens: int,
                     opts: GreedyGateOptions, concurrency: int | None = 1, name: str = "greedy",
                     max_tokens_each: Sequence[int] | None = None, baseline_concurrency: int | None = None,
                     on_prompt: Callable[[PromptCheck], None] | None = None) -> GateRun:
    """Candidate generations (`concurrency` at a time), then each checked against its own baselines."""
    if not prompts:
        raise LosslessError("the prompt set is empty")
    opts = resolve_rule(opts, baseline, candidate)
    t0 = time.perf_counter()
    mts = list(max_tokens_each) if max_tokens_each is not None else [max_tokens] * len(prompts)
    reqs = [prompt_request(p, m, rid=f"{name}-{p.pid}") for p, m in zip(prompts, mts, strict=True)]
    before = await candidate.spec_counters()
    cands = await candidate.generate(reqs, concurrency=concurrency)
    delta = counters_delta(before, await candidate.spec_counters())
    sem = asyncio.Semaphore(baseline_concurrency or concurrency or len(prompts))
    rendered: list[str] = []  # chat prompts: where the rendered ids came from
    same_kind = same_engine_kind(baseline, candidate)

    async def one(p: Prompt, c: GenResult, m: int) -> PromptCheck:
        async with sem:
            first = None
            if p.chat:  # the same chat request to the baseline, with logprobs: the first baseline
                first = await _one(baseline, prompt_request(p, m, rid=f"{name}-base-{p.pid}", logprobs=opts.top_k))
                ids, problem = rendered_prompt(first, c) if first.ok and c.ok else (None, None)
                rendered.append("both" if first.prompt_ids is not None and c.prompt_ids is not None else
                                "one" if ids else "none")
                p = replace(p, ids=ids or [])
                if problem:
                    pc = PromptCheck(p.pid, 0, m, status="untestable", complete=False, spec=c.spec,
                                     missing="the same rendered chat prompt on both arms", reason=f"{CANNOT_TEST}: {problem}")
                    if on_prompt is not None:
                        on_prompt(pc)
                    return pc
            pc = await check_output(baseline, p, c, m, opts, candidate if opts.rescore else None, first_base=first,
                                    compare_text=same_kind)
        if on_prompt is not None:
            on_prompt(pc)
        return pc

    checks = await asyncio.gather(*(one(p, c, m) for p, c, m in zip(prompts, cands, mts, strict=True)))
    run = await finish_run(name, candidate, baseline, list(checks), cands, delta, opts, t0, engine_k(candidate), mts)
    if rendered:
        run.notes.append(f"chat endpoint: {len(rendered)} chat requests (one user message, the server's chat "
                         f"template); rendered prompt ids reported by both arms for {rendered.count('both')}, by one "
                         f"for {rendered.count('one')}, by neither for {rendered.count('none')}")
    return run
