"""What several engine gates share: the model geometry, echo prompts, the shaped judge, the stop judges.

- `geometry(adapter)`: (max_position_embeddings, usable context) of a local engine (headroom, long-context).
- `echo_prompts`: prompt + the baseline's greedy answer + the prompt again, so drafts are accepted (long-context,
  penalties, logit-bias, min-tokens).
- `judge_shaped` (and `MASKED`): a greedy output of shaped logits (penalties, a logit bias, min_tokens, ignore_eos)
  against its baseline, up to and including the first divergence; `untestable`: a case whose baseline does not
  honour the option under test.
- `judge_stop_divergence` (stop-in-run, eos-in-run) and `stop_inside_run` (eos-in-run, min-tokens): a stop's
  first divergence, and whether a stop landed inside an accepted run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

from specbench.harness.adapters.base import EngineAdapter, GenResult
from specbench.harness.verdicts import CANNOT_TEST

from ..greedy import GreedyGateOptions, cannot_compare, position_dist, recover_dist
from ..outcomes import Divergence, Prompt, PromptCheck
from ..regret import first_divergence, judge_pick


def geometry(adapter: EngineAdapter) -> tuple[int, int] | None:
    """(max_position_embeddings, usable context) of a local engine, else None."""
    d = adapter.describe() or {}
    raw = d.get("config")
    cfg = raw if isinstance(raw, dict) else {}
    model, usable = d.get("model"), cfg.get("max_model_len")
    try:
        max_pos = json.loads((Path(str(model)) / "config.json").read_text())["max_position_embeddings"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (int(max_pos), int(usable)) if isinstance(usable, int) else None


async def judge_stop_divergence(pc: PromptCheck, i: int, cid: list[int], bid: list[int], baseline: EngineAdapter,
                                 p: Prompt, b: GenResult, opts: GreedyGateOptions, what: str, past: str) -> None:
    """Judge a stop gate's first divergence `i` of candidate ids `cid` from baseline ids `bid` into `pc`:
    tokens past the baseline's stop (`past` says where), an early stop, or a token judged by the regret rule
    at the divergence (a benign flip before the `what` leaves the stop unexercised)."""
    if i >= len(bid):
        pc.divergences.append(Divergence(i, "past_stop", cid[i], None, 0))
        pc.status, pc.tokens_compared = "fail", i
        pc.reason = f"{len(cid) - len(bid)} token(s) {past}"
    elif i >= len(cid):
        pc.divergences.append(Divergence(i, "early_stop", None, bid[i], 0))
        pc.status, pc.reason = "fail", f"the candidate stopped {len(bid) - len(cid)} token(s) before the baseline"
    else:
        dist = position_dist(b.logprobs, i)
        if not dist:
            dist, _, note = await recover_dist(baseline, list(p.ids) + cid[:i], cid[i], opts.top_k)
            if not dist:
                pc.status, pc.missing, pc.reason = "untestable", "baseline logprobs at the divergence", note
                return
        j = judge_pick(cid[i], dist, opts.tol)
        pc.divergences.append(Divergence(i, "token", cid[i], bid[i], 0, j))
        pc.status, pc.tokens_compared, pc.complete = ("flip" if j.ok else "fail"), i + 1, False
        pc.reason = f"benign flip before the {what}: the stop was not exercised" if j.ok else j.describe()


def stop_inside_run(res: GenResult, stop_pos: int, delta: dict | None) -> bool | None:
    """Did the stop at output position `stop_pos` land inside an accepted run (drafts accepted past it in the
    step that emitted it)? From the per-step accepted runs and chunks where the engine reports them (one chunk
    per step: the prefill's first token, then one per verify step), else from the request's counter delta (the
    run was cut short: fewer tokens than 1 + drafts + accepted); None when neither is known."""
    ids = res.output_ids or []
    runs = (res.spec or {}).get("accepted_runs")
    if runs is not None and res.chunk_tokens and sum(res.chunk_tokens) == len(ids) and stop_pos < len(ids):
        start = 0
        for c, n in enumerate(res.chunk_tokens):
            if start <= stop_pos < start + n:
                j = c - 1  # chunk 0 is the prefill's token
                return 0 <= j < len(runs) and stop_pos - start < runs[j]
            start += n
        return False
    if delta and delta.get("num_drafts") is not None and delta.get("num_accepted_tokens") is not None:
        return len(ids) < 1 + int(delta["num_drafts"]) + int(delta["num_accepted_tokens"])
    return None


MASKED = -1e4  # a masked token's score in a shaped judge (min_tokens): any pick of it fails by this much


def judge_shaped(pid: str, p: Prompt, cand: GenResult, base: GenResult, max_tokens: int, opts: GreedyGateOptions,
                 score: Callable[[dict[int, float], list[int], int], dict[int, float]], label: str) -> PromptCheck:
    """A greedy output of shaped logits (penalties, a logit bias, min_tokens) against its baseline, up to and including
    the first divergence. `score(dist, prefix, i)`: the shaped score of each token of the baseline's reported
    distribution at position i after the common prefix; shaping is a per-row shift of the logprobs where the
    processors are additive, so the pick's regret under it is exact from the reported logprobs. A benign flip ends
    the comparison (a re-anchored baseline would count the prefix as prompt, not output); a length difference
    fails (early or past the baseline's stop)."""
    pc = PromptCheck(pid, len(p.ids), max_tokens, spec=cand.spec)
    if cannot_compare(pc, (("candidate", cand), ("baseline", base))):
        return pc
    c, b = list(cand.output_ids or []), list(base.output_ids or [])
    pc.candidate_tokens = len(c)
    i = first_divergence(c, b)
    if i is None:
        pc.tokens_compared = len(c)
        return pc
    pc.tokens_compared = i
    if i >= len(b) or i >= len(c):
        kind = "past_stop" if i >= len(b) else "early_stop"
        pc.divergences.append(Divergence(i, kind, c[i] if i < len(c) else None, b[i] if i < len(b) else None, 0))
        pc.status, pc.reason = "fail", pc.divergences[-1].describe()
        return pc
    dist = position_dist(base.logprobs, i)
    if not dist:
        pc.status, pc.missing = "untestable", "baseline logprobs at the divergence"
        pc.reason = f"{CANNOT_TEST} at position {i}: the baseline reported no logprobs there"
        return pc
    j = judge_pick(c[i], score(dist, b[:i], i), opts.tol)
    pc.divergences.append(Divergence(i, "token", c[i], b[i], 0, judgement=j, dist_source=f"generation, {label}"))
    pc.status = "flip" if j.ok else "fail"
    pc.reason = pc.divergences[-1].describe() + (" (compared up to this benign flip)" if j.ok else "")
    return pc


def untestable(pid: str, p: Prompt, cand: GenResult, max_tokens: int, missing: str) -> PromptCheck:
    """A case the gate cannot judge: its baseline shows no sign of honouring the option under test."""
    pc = PromptCheck(pid, len(p.ids), max_tokens, spec=cand.spec)
    pc.status, pc.missing, pc.reason = "untestable", missing, f"{CANNOT_TEST}: {missing}"
    return pc


def echo_prompts(ps: Sequence[Prompt], firsts: Sequence[GenResult]) -> list[Prompt]:
    """Prompt + the baseline's greedy answer + the prompt again: the answer comes back, so drafts are accepted."""
    return [Prompt(f"{p.pid}-echo", list(p.ids) + list(b.output_ids or []) + list(p.ids))
            for p, b in zip(ps, firsts, strict=True)]
