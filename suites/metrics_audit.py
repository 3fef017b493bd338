"""The client-side audit of server metrics: do an endpoint's /metrics agree with what its client saw?

Used by the sweep (one window per cell, suites/sweep/audit.py) and by the lossless batch-invariance and
divergence-rate gates (one window per run of requests, suites/lossless/batch.py). Works on any adapter
with `metrics_text()` (an openai endpoint's /metrics, the local engine's own text).

Contract:
- `summarize(text, model)` reduces Prometheus text to the families audited (below), summed over label
  sets (restricted to `model_name=model` where the server labels samples with it); `scrape(adapter)`
  does it for an adapter (None without metrics); `settle(adapter)` scrapes until the gauges read idle (the
  scrape before a window) and `settle(adapter, before, requests, k, per_step)` until the window audits clean
  against what the client sent (a server may publish a request's counts after answering it), at most
  SETTLE_SCRAPES scrapes with growing pauses, and marks the summary with how it ended (`settle`: agreed, or
  not: stable, or still moving); `ready(adapter)` probes an endpoint first, so its probe requests never land
  inside a window; `audited(adapter, run)` is the three around one run.
- `audit_window(before, after, requests, k, per_step_stream)` is a pure function of two summaries taken
  around a window in which the client sent exactly `requests` (GenResults or request-record dicts). It
  returns {"verdict", "checks", "problems", "missing", "unattributed", "client", "server"}: FAIL with the
  problems, PASS when every check that could run agreed, CANNOT TEST when no check could run (no /metrics,
  or none of the families) or when the counters cannot be attributed to the window (`unattributed`, the
  reason, also in `missing`): the server was busy before it, its counters were still moving when the settle
  gave up, or more requests finished than the client sent, with tokens of their own (other traffic). Then
  no counter or gauge is judged: never a FAIL on evidence that may be someone else's. Checks that could
  not run are named in `missing`.

What the client sees: per request its output tokens (usage), prompt tokens, the tokens each streamed
chunk carried (`chunk_tokens`, counted exactly where `token_count_method` says so: harness/adapters/base.py
`counted_exactly`), the finish reason and, where the server reports them, per-request draft counts (`spec`).

The checks (slack: what a correct server may differ by, documented in docs/sweep.md):
- idle before: running and waiting gauges are 0 before the window; else the counter deltas include other
  traffic: unattributed (above).
- requests: the delta of `vllm:request_success_total` (finished_reason abort / error excluded) equals the
  requests the client got a complete answer for (slack 0; with client-side failures, between the
  successes and successes + failures). More, with more tokens than the client's too: unattributed; more
  with no tokens of their own: FAIL (the counter counts requests that never ran).
- output tokens: the delta of `vllm:generation_tokens_total` / `llamacpp:tokens_predicted_total` equals
  the sum of the client's usage counts (slack 0; with failures: at least the successes' sum).
- prompt tokens: the delta of `vllm:prompt_tokens_total` equals the sum of the client's prompt tokens
  (slack 0; not for llama.cpp, whose counter leaves out tokens its prompt cache held).
- spec counters vs output tokens (every request ok, exact chunk counts): every accepted draft token is an
  output token, and every verify step emits at least one, so with n requests and T output tokens
  accepted <= T - n + K x n (K = draft width: the last step's accepted run may be cut by EOS, a stop or
  max_tokens) and verify steps <= T - n + n (one discarded step per request allowed).
- tokens per streamed chunk (servers that stream one event per engine step: the local engine and
  `specbench serve`): a chunk with c tokens came from one verify step that accepted c - 1 drafts, so
  sum(max(0, c - 1)) <= accepted and (chunks with c > 1) <= verify steps; and accepted <= sum(max(0, c - 1))
  + K x n (only a request's last step can lose accepted tokens, to a stop or max_tokens): more is an
  overstated acceptance. Elsewhere (vLLM merges the
  deltas of steps a slow client has not read yet) the figures are reported, not judged. Per request too,
  where the server reports per-request draft counts.
- gauges after: running, waiting, `specbench:requests_in_flight` and KV usage (`vllm:kv_cache_usage_perc`,
  `vllm:gpu_cache_usage_perc`, `sglang:token_usage`) read 0 once the window's requests are done (after
  `settle`); a gauge still non-zero is stale (FAIL). llama.cpp's KV figures are not judged: a slot keeps
  its last prompt by design.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from specbench.harness.adapters.base import EngineAdapter, counted_exactly
from specbench.harness.adapters.prom import parse_prometheus, spec_counters_from_metrics
from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS

REQUESTS = ("vllm:request_success_total",)
NOT_SUCCESS = ("abort", "error")  # finished_reason values that are no successful request
GEN_TOKENS = ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total")
PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
RUNNING = ("vllm:num_requests_running", "specbench:requests_in_flight", "llamacpp:requests_processing",
           "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
GAUGE_EPS = 1e-9


def _num(v: float) -> int | float:
    return int(v) if float(v).is_integer() else v


def summarize(text: str, model: str | None = None) -> dict:
    """The audited families of one /metrics text: counters, gauges (name -> value) and spec counters."""
    samples = parse_prometheus(text)
    if model is not None and any(lab.get("model_name") == model for _, lab, _ in samples):
        samples = [s for s in samples if s[1].get("model_name") in (None, model)]
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    names: set[str] = set()
    for name, labels, value in samples:
        if name in REQUESTS:
            key = "requests_not_ok" if labels.get("finished_reason") in NOT_SUCCESS else "requests_ok"
            counters[key] = counters.get(key, 0.0) + value
        elif name in GEN_TOKENS:
            counters["generation_tokens"] = counters.get("generation_tokens", 0.0) + value
        elif name in PROMPT_TOKENS:
            counters["prompt_tokens"] = counters.get("prompt_tokens", 0.0) + value
        elif name in RUNNING + WAITING + KV_USAGE:
            gauges[name] = gauges.get(name, 0.0) + value
        else:
            continue
        names.add(name)
    return {"counters": {k: _num(v) for k, v in counters.items()}, "gauges": gauges, "names": sorted(names),
            "spec": spec_counters_from_metrics(text, model), "t": time.time()}


async def scrape(adapter: Any) -> dict | None:
    fn = getattr(adapter, "metrics_text", None)
    if fn is None:
        return None
    try:
        text = await fn()
    except Exception:  # an unreachable /metrics is a missing capability, never a crash of the gate
        return None
    if not text:
        return None
    return summarize(text, getattr(adapter, "model", None))


def busy_gauges(s: dict | None, kv: bool = True) -> dict[str, float]:
    """The gauges of a summary that are not idle (running, waiting, in flight; KV usage with kv=True)."""
    if not s:
        return {}
    judged = RUNNING + WAITING + (KV_USAGE if kv else ())
    return {n: v for n, v in (s.get("gauges") or {}).items() if n in judged and abs(v) > GAUGE_EPS}


SETTLE_SCRAPES = 12  # the most scrapes one settle takes
SETTLE_STABLE = 3  # counters equal over this many last scrapes: what the server publishes, final
SETTLE_FIRST_S = 0.01  # the pause before the second scrape, doubled before each next one ...
SETTLE_MAX_S = 0.5  # ... up to this (12 scrapes span about 3 s)


def _published(s: dict) -> tuple:
    """What must stop moving for a scrape to be final: the counters and the spec counters (gauges excluded)."""
    spec = s.get("spec") or {}
    return (sorted((s.get("counters") or {}).items()),
            [spec.get(k) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")])


async def settle(adapter: Any, before: dict | None = None, requests: Sequence[Any] | None = None,
                 k: int | None = None, per_step: bool = False, scrapes: int | None = None) -> dict | None:
    """Scrape until the server has published everything the client knows it sent, at most `scrapes` times
    (default SETTLE_SCRAPES), pausing SETTLE_FIRST_S doubling up to SETTLE_MAX_S between scrapes.

    With `before` and `requests` (the window's), it stops at the first scrape whose window audits clean against
    them (`audit_window`: counters match, gauges idle, nothing unattributed): a server may publish a request's
    counts after its response (the engine in a process of its own did, from a 50 ms cache). Without them (the
    scrape before a window) it stops once the gauges read idle. The summary returned (None: no /metrics) carries
    `settle`: {"scrapes", "agreed", "stable"}; `stable` when it did not agree but its counters were equal over the
    last SETTLE_STABLE scrapes, so what they say is what the server says (judged); a window whose counters were
    still moving is not judged (`audit_window`: CANNOT TEST, named)."""
    n = scrapes or SETTLE_SCRAPES
    if type(adapter).metrics_text is EngineAdapter.metrics_text:  # publishes no /metrics at all: nothing to wait for
        return None
    # the window to judge each scrape against: only with both ends known and an idle server before it
    idle_before = before is not None and requests is not None and not busy_gauges(before, kv=False)
    judged = requests if idle_before else None
    seen: list[dict] = []
    pause = SETTLE_FIRST_S
    for i in range(n):
        if i:
            await asyncio.sleep(pause)
            pause = min(SETTLE_MAX_S, pause * 2)
        s = await scrape(adapter)
        if s is None:
            continue
        seen.append(s)
        if judged is not None:
            w = audit_window(before, s, judged, k=k, per_step=per_step)
            agreed = not w["problems"] and not w.get("unattributed")
        else:
            agreed = not busy_gauges(s)
        if agreed:
            s["settle"] = {"scrapes": i + 1, "agreed": True, "stable": True}
            return s
    if not seen:
        return None
    last = seen[-1]
    stable = len(seen) >= SETTLE_STABLE and all(_published(x) == _published(last) for x in seen[-SETTLE_STABLE:])
    last["settle"] = {"scrapes": n, "agreed": False, "stable": stable}
    return last


def per_step_stream(describe: dict | None) -> bool:
    """Does this engine stream one chunk per engine step (so a chunk's tokens are one step's)?"""
    d = describe or {}
    return d.get("kind") == "local" or d.get("dialect") == "specbench"


def _view(r: Any) -> dict:
    g = r.get if isinstance(r, dict) else (lambda k, default=None: getattr(r, k, default))
    return {"ok": bool(g("ok")), "completion_tokens": g("completion_tokens"), "prompt_tokens": g("prompt_tokens"),
            "chunk_tokens": list(g("chunk_tokens") or []), "method": g("token_count_method"),
            "finish_reason": g("finish_reason"), "spec": g("spec"), "rid": g("rid")}


def client_view(requests: Sequence[Any]) -> dict:
    """What the client saw, summed: requests, output / prompt tokens, chunks and multi-token chunks."""
    vs = [_view(r) for r in requests]
    ok = [v for v in vs if v["ok"]]
    exact = bool(ok) and all(counted_exactly(v["method"]) for v in ok)
    out = {"requests": len(vs), "ok": len(ok), "failed": len(vs) - len(ok),
           "output_tokens": sum(int(v["completion_tokens"] or 0) for v in ok),
           "prompt_tokens": sum(int(v["prompt_tokens"] or 0) for v in ok),
           "prompt_tokens_known": all(v["prompt_tokens"] is not None for v in ok),
           "exact_chunks": exact, "chunks": sum(len(v["chunk_tokens"]) for v in ok),
           "extra_chunk_tokens": sum(max(0, c - 1) for v in ok for c in v["chunk_tokens"]),
           "multi_token_chunks": sum(1 for v in ok for c in v["chunk_tokens"] if c > 1)}
    out["per_request"] = vs
    return out


def _delta(before: dict, after: dict, key: str) -> float | None:
    a, b = (after.get("counters") or {}).get(key), (before.get("counters") or {}).get(key)
    if a is None:
        return None
    return a - (b or 0)


def audit_window(before: dict | None, after: dict | None, requests: Sequence[Any], k: int | None = None,
                 per_step: bool = False, label: str = "") -> dict:
    """Hold the server's counters and gauges around one window against what the client saw (module doc)."""
    pre = f"{label}: " if label else ""
    cv = client_view(requests)
    client = {x: y for x, y in cv.items() if x != "per_request"}
    out: dict = {"verdict": CANNOT_TEST, "checks": [], "problems": [], "missing": [], "client": client,
                 "server": {}, "label": label}
    if before is None or after is None:
        out["missing"].append(pre + "server metrics (/metrics) before and after the run")
        return out
    checks, problems, missing = out["checks"], out["problems"], out["missing"]
    server = out["server"]
    server["names"] = sorted(set(before.get("names") or []) | set(after.get("names") or []))
    busy_before = {n: v for n, v in busy_gauges(before, kv=False).items()}
    n_ok, n_fail, t_out = cv["ok"], cv["failed"], cv["output_tokens"]
    how = after.get("settle") or {}
    why: str | None
    if busy_before:
        why = ("the server was busy before the window (" + ", ".join(f"{n} {v:g}" for n, v in busy_before.items())
               + "): its counter deltas would include other traffic")
    elif how and not how.get("agreed", True) and not how.get("stable", True):
        why = (f"the server's counters were still moving after {how.get('scrapes')} scrapes (they never settled): "
               "their deltas cannot be attributed to this window")
    else:
        why = _other_traffic(before, after, cv)
    out["unattributed"] = why
    if why:
        missing.append(pre + why)
    else:
        d = _delta(before, after, "requests_ok")
        if d is not None:
            server["requests_ok"] = d
            lo, hi = n_ok, n_ok + n_fail
            checks.append(f"requests: counter delta {d:g} vs {n_ok} complete answers"
                          + (f" (+ {n_fail} failed)" if n_fail else ""))
            if not lo <= d <= hi:
                problems.append(pre + f"request counter delta {d:g} != {n_ok} requests the client got a complete "
                                f"answer for" + (f" (+{n_fail} failed)" if n_fail else ""))
        else:
            missing.append(pre + "a request counter (vllm:request_success_total)")
        d = _delta(before, after, "generation_tokens")
        if d is not None:
            server["generation_tokens"] = d
            checks.append(f"output tokens: counter delta {d:g} vs {t_out} in the client's usage")
            if (d != t_out) if not n_fail else (d < t_out):
                problems.append(pre + f"output-token counter delta {d:g} != {t_out} output tokens the client "
                                "received (usage)")
        else:
            missing.append(pre + "an output-token counter (vllm:generation_tokens_total, "
                           "llamacpp:tokens_predicted_total)")
        d = _delta(before, after, "prompt_tokens")
        if d is not None and cv["prompt_tokens_known"]:
            server["prompt_tokens"] = d
            t_in = cv["prompt_tokens"]
            checks.append(f"prompt tokens: counter delta {d:g} vs {t_in} in the client's usage")
            if (d != t_in) if not n_fail else (d < t_in):
                problems.append(pre + f"prompt-token counter delta {d:g} != {t_in} prompt tokens of the client's "
                                "requests (usage)")
        _spec_checks(before, after, cv, k, per_step, pre, out)
    stale = busy_gauges(after, kv=True)
    gauges_seen = [n for n in (after.get("gauges") or {}) if n in RUNNING + WAITING + KV_USAGE]
    if why:  # other traffic, or counters still moving: the gauges may be someone else's requests
        pass
    elif gauges_seen:
        checks.append("gauges after the run: " + ", ".join(f"{n} {after['gauges'][n]:g}" for n in gauges_seen))
        if stale:
            problems.append(pre + "gauges still non-zero after every request finished: "
                            + ", ".join(f"{n} = {v:g}" for n, v in stale.items()) + " (stale)")
    else:
        missing.append(pre + "running / waiting / KV-usage gauges")
    server["gauges_after"] = dict(after.get("gauges") or {})
    server["gauges_before"] = dict(before.get("gauges") or {})
    if how:
        server["settle"] = dict(how)
    out["verdict"] = FAIL if problems else (CANNOT_TEST if why or not checks else PASS)
    return out


def _other_traffic(before: dict, after: dict, cv: dict) -> str | None:
    """More finished requests than the client sent, carrying tokens of their own: someone else's requests (or the
    harness's own outside this window) finished inside it, so no counter delta is this window's. Extra requests
    with no extra tokens are the request counter's own error, judged by the request check (None here)."""
    d = _delta(before, after, "requests_ok")
    hi = cv["ok"] + cv["failed"]
    if d is None or d <= hi:
        return None
    gen, prompt = _delta(before, after, "generation_tokens"), _delta(before, after, "prompt_tokens")
    more = (gen is not None and gen > cv["output_tokens"]) or \
        (prompt is not None and cv["prompt_tokens_known"] and prompt > cv["prompt_tokens"])
    if not more and (gen is not None or prompt is not None):
        return None
    return (f"{d - hi:g} more finished requests than the client sent ({d:g} vs {hi}), with tokens of their own: other "
            "traffic on the server during the window, so its counter deltas cannot be attributed to it")


def _spec_checks(before: dict, after: dict, cv: dict, k: int | None, per_step: bool, pre: str, out: dict) -> None:
    sa, sb = after.get("spec"), before.get("spec")
    if not sa or sa.get("num_drafts") is None:
        return
    sb = sb or {}
    drafts = int(sa.get("num_drafts") or 0) - int(sb.get("num_drafts") or 0)
    acc = int(sa.get("num_accepted_tokens") or 0) - int(sb.get("num_accepted_tokens") or 0)
    out["server"].update(num_drafts=drafts, num_accepted_tokens=acc)
    checks, problems, missing = out["checks"], out["problems"], out["missing"]
    if cv["failed"] or not cv["ok"]:
        missing.append(pre + "spec counters vs output tokens (a request failed: its tokens are unknown)")
        return
    kk = k or len(sa.get("accepted_per_pos") or []) or 0
    n, t = cv["ok"], cv["output_tokens"]
    emitted = t - n  # output tokens past each request's first (prefill) token
    checks.append(f"spec counters vs output tokens: accepted {acc} <= {emitted} + K x {n} (K = {kk}), "
                  f"verify steps {drafts} <= {emitted} + {n}")
    if acc > emitted + kk * n:
        problems.append(pre + f"accepted-token counter delta {acc} > {emitted} output tokens past the first of each "
                        f"request + K x requests ({kk} x {n}): the counters count tokens the client never received")
    if drafts > emitted + n:
        problems.append(pre + f"verify-step counter delta {drafts} > {emitted} output tokens past the first of each "
                        f"request + {n}: every verify step emits at least one token")
    if not cv["exact_chunks"]:
        missing.append(pre + "tokens per streamed chunk (the per-chunk counts are estimates)")
        return
    x, m = cv["extra_chunk_tokens"], cv["multi_token_chunks"]
    out["server"].update(extra_chunk_tokens=x, multi_token_chunks=m)
    line = (f"tokens per chunk: {x} tokens beyond the first of their chunk vs {acc} accepted; {m} multi-token "
            f"chunks vs {drafts} verify steps")
    if not per_step:
        checks.append(line + " (reported, not judged: this server may merge steps into one chunk)")
        return
    checks.append(line + f"; accepted {acc} <= {x} + K x {n}")
    if acc > x + kk * n:
        problems.append(pre + f"the accepted-token counter grew by {acc}, but the stream carried {x} tokens beyond the "
                        f"first of their chunk: at most K x requests ({kk} x {n}) more can have been cut by a stop or "
                        "max_tokens in a request's last step, so the counters overstate acceptance")
    if x > acc:
        problems.append(pre + f"the client received {x} tokens beyond the first of their streamed chunk, but the "
                        f"accepted-token counter grew by {acc}: the counters miss accepted drafts")
    if m > drafts:
        problems.append(pre + f"{m} streamed chunks carried several tokens, but the verify-step counter grew by "
                        f"{drafts}")
    bad = []
    for v in cv["per_request"]:
        sp = v["spec"] if isinstance(v["spec"], dict) else None
        if not v["ok"] or sp is None or sp.get("num_accepted_tokens") is None:
            continue
        xr = sum(max(0, c - 1) for c in v["chunk_tokens"])
        mr = sum(1 for c in v["chunk_tokens"] if c > 1)
        ar = int(sp["num_accepted_tokens"])
        if xr > ar or ar > xr + kk or (sp.get("num_drafts") is not None and mr > int(sp["num_drafts"])):
            bad.append(f"{v['rid']} ({xr} extra chunk tokens vs {sp['num_accepted_tokens']} accepted, {mr} multi-token "
                       f"chunks vs {sp.get('num_drafts')} verify steps)")
    if any(isinstance(v["spec"], dict) for v in cv["per_request"]):
        checks.append("tokens per chunk vs each request's own draft counts")
    if bad:
        problems.append(pre + "per-request draft counts disagree with what the stream carried: " + "; ".join(bad[:3])
                        + (f" and {len(bad) - 3} more" if len(bad) > 3 else ""))


def combine_windows(windows: Sequence[dict]) -> dict:
    """One verdict over several windows: FAIL if any failed, PASS if any passed and none failed, else CANNOT TEST."""
    problems = [p for w in windows for p in w["problems"]]
    missing = sorted({m for w in windows for m in w["missing"]})
    verdicts = [w["verdict"] for w in windows]
    v = FAIL if problems else (PASS if PASS in verdicts else CANNOT_TEST)
    return {"verdict": v, "windows": len(windows), "problems": problems, "missing": missing,
            "checks": sorted({c.split(":")[0] for w in windows for c in w["checks"]})}


async def ready(adapter: Any) -> None:
    """Probe an endpoint's dialect now (openai adapters probe on first use, with requests of their own), so
    that no probe request lands inside an audited window."""
    fn = getattr(adapter, "probe", None)
    if callable(fn):
        try:
            await asyncio.to_thread(fn)
        except Exception:  # the run itself will report an unusable endpoint
            pass


async def audited(adapter: Any, run, k: int | None = None, per_step: bool | None = None
                  ) -> tuple[Any, dict | None, dict | None]:
    """Probe, settle (idle), await `run()` (a coroutine factory returning the window's results), settle against
    them: (its result, before, after). `per_step` defaults to what the adapter's describe() says."""
    await ready(adapter)
    before = await settle(adapter)
    res = await run()
    if per_step is None:
        try:
            per_step = per_step_stream(adapter.describe())
        except Exception:
            per_step = False
    after = await settle(adapter, before, res, k=k, per_step=per_step) if before is not None else None
    return res, before, after
