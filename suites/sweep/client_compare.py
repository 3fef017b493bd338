"""specbench's client against vLLM's own (`vllm bench serve`) on one server, per load level (issue 28 item 3).

Both clients leave one vLLM-format result file per cell: `vllm bench serve --save-result --save-detailed`
writes vLLM's, `specbench sweep --result-dir` a copy of each cell's (vllm_format.py, the same fields and
units). The figures are read from those files, both through `from_vllm`, the reader `specbench import
vllm-bench` uses, so the two sides are read by one piece of code.

Contract:
- `round_metrics(obj)`: one such dict -> the compared figures of that round: output tok/s; median TTFT,
  TPOT, ITL and E2EL in ms (ITL per streamed chunk on both sides: vLLM's convention, which specbench's
  files keep under the same key); specbench's per-token ITL where the file has it (its own files only);
  acceptance from the counters in the file (length 1 + accepted / drafts, rate accepted / draft tokens as a
  fraction) and from the stream (`stream_al`: output tokens after the first chunk per chunk gap, pooled
  over successful requests; needs the per-request lists, i.e. --save-detailed), with the requests and gaps
  it pooled (for the truncation bound below).
- `spread(values)`: one client's figure over its rounds: median, min, max, and its noise floor
  `noise` = (max - min) / median, the relative range (None with fewer than two rounds).
- `compare_clients(vllm, specbench, k=None)`: {level: [round metrics or None, ...]} per client, rounds in
  the order run (round r of specbench ran right after round r of vLLM bench, so drift hits both) -> per
  level and metric: both spreads, the paired ratios specbench_r / vllm_r (rounds present on both sides),
  their median, the noise floor (the larger of the two clients' own), and a verdict: "within noise"
  (|median ratio - 1| <= noise floor), "differs", "no noise floor" (a client with fewer than two rounds),
  "missing" (one side lacks the figure) or "n/a" (neither has it: no speculation, no acceptance). Per
  client and level also the acceptance self-check, counters against the stream (`stream_check`):
  "equal within noise", "explained: truncated last block" (counters AL - stream AL in [0, K x requests /
  gaps], K the draft length: the last verify step of a request hitting max_tokens can accept tokens that
  are cut from the output), "differs", "no counters" or "no stream lists".
- `render_markdown(jobs)`: the tables of one or more compared jobs, with the conventions (`CONVENTIONS`).
Pure: no I/O beyond what the caller passes in.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from .compare import paired_ratios
from .vllm_format import from_vllm

COMPARED = ("output_tok_s", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "acceptance_length", "acceptance_rate",
            "stream_al")
LABELS = {"output_tok_s": "output tok/s", "ttft_ms": "TTFT median (ms)", "tpot_ms": "TPOT median (ms)",
          "itl_ms": "ITL median, per chunk (ms)", "e2el_ms": "E2EL median (ms)",
          "acceptance_length": "acceptance length (counters)", "acceptance_rate": "acceptance rate (counters)",
          "stream_al": "tokens per chunk gap (stream)"}
CLIENTS = ("vllm", "specbench")

CONVENTIONS = (
    "ITL: both files' `*_itl_ms` are the gap between consecutive streamed chunks, one entry per chunk after "
    "the first (vLLM's convention; specbench's vLLM-format file keeps it under the same key). specbench's "
    "per-token ITL (each gap spread over the tokens its chunk carried) is listed beside it: under speculation "
    "a chunk carries about an acceptance length of tokens, so per chunk ~ AL x per token; without it they are "
    "equal. vLLM bench records no tokens per chunk, so it has no per-token ITL.",
    "TPOT: both (E2EL - TTFT) / (output tokens - 1), output tokens from the server's usage count: the first "
    "token is excluded on both sides. E2EL ends at the last content chunk vLLM bench reads and at the chunk "
    "completing the last counted token in specbench (the same with --ignore-eos: no tokens after EOS).",
    "TTFT: send to the first chunk carrying output on both sides (specbench: from the first send of the "
    "first attempt; a retry would count, none is expected against a healthy server).",
    "Output tok/s: output tokens (usage) / the timed window. vLLM bench: first request sent to the last done "
    "(its test request and --num-warmups excluded). specbench: the cell's wall time, first send to last "
    "response, its warm-up wave excluded, and at c1 the time of the per-request /metrics scrapes taken off.",
    "Acceptance: length = 1 + accepted / drafts, where vLLM's drafts counter counts draft steps (one per "
    "request per verify step), so it is committed tokens per verify step, specbench's token-weighted AL; "
    "rate = accepted / draft tokens (vLLM's file says percent, shown here as a fraction). Both clients read "
    "the server's /metrics counters (server-wide): vLLM bench around its benchmark run, specbench around each "
    "cell (at c1 around each request, summed).",
    "Stream acceptance: (output tokens - 1) / chunk gaps, pooled over requests: the first chunk is taken to "
    "carry the prefill's one token, as a vLLM server streams it (a server whose first chunk carries more reads "
    "high). Counters AL - stream AL in [0, K x requests / gaps] is the truncated last "
    "block; verify steps without a draft (an n-gram miss) and chunks merged on the way (a client or server "
    "falling behind) move the stream figure the other way.",
    "Noise floor: each client's own round-to-round spread, (max - min) / median over its rounds; a ratio "
    "within the larger of the two is not a difference the rounds can resolve.",
)


def _finite(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _ms(v: Any) -> float | None:
    f = _finite(v)
    return None if f is None else f * 1e3


def round_metrics(obj: Mapping[str, Any], where: str = "file") -> dict[str, Any]:
    """One vLLM-format result dict (vLLM bench's, or a sweep cell's) -> the figures compared per round."""
    cell = from_vllm(dict(obj), where)
    st = cell["stats"]
    out: dict[str, Any] = {
        "output_tok_s": _finite(st["output_tok_s"]), "ttft_ms": _ms(st["ttft"]["median"]),
        "tpot_ms": _ms(st["tpot"]["median"]), "itl_ms": _ms(st["chunk_gap"]["median"]),
        "itl_per_token_ms": _ms(st["itl"]["median"]), "e2el_ms": _ms(st["e2el"]["median"]),
        "completed": st["completed"], "failed": st["failed"], "output_tokens": st["output_tokens"],
        "duration_s": _finite(st["duration"]), "acceptance_length": None, "acceptance_rate": None,
        "num_drafts": None, "stream_al": None, "stream_requests": 0, "stream_gaps": 0,
    }
    c = cell["counters"]
    if c and c.get("num_drafts"):
        out["num_drafts"] = int(c["num_drafts"])
        out["acceptance_length"] = 1.0 + c["num_accepted_tokens"] / c["num_drafts"]
        if c.get("num_draft_tokens"):
            out["acceptance_rate"] = c["num_accepted_tokens"] / c["num_draft_tokens"]
    outs, itls, errs = obj.get("output_lens"), obj.get("itls"), obj.get("errors") or []
    if isinstance(outs, list) and isinstance(itls, list) and len(outs) == len(itls):
        toks = gaps = reqs = 0
        for i, (n, g) in enumerate(zip(outs, itls, strict=True)):
            if (i < len(errs) and errs[i]) or not n or not isinstance(g, list) or not g:
                continue
            toks, gaps, reqs = toks + int(n) - 1, gaps + len(g), reqs + 1
        if gaps:
            out.update(stream_al=toks / gaps, stream_requests=reqs, stream_gaps=gaps)
    return out


def spread(values: Sequence[Any]) -> dict | None:
    """Median, min, max and the noise floor (max - min) / median of one client's figure over rounds."""
    vs = [f for f in (_finite(v) for v in values) if f is not None]
    if not vs:
        return None
    med = statistics.median(vs)
    noise = None
    if len(vs) >= 2:
        noise = (max(vs) - min(vs)) / abs(med) if med else (0.0 if max(vs) == min(vs) else math.inf)
    return {"median": med, "min": min(vs), "max": max(vs), "rounds": len(vs), "noise": noise, "values": vs}


def _figure(rounds: Sequence[Mapping | None], key: str) -> list[float | None]:
    return [None if r is None else _finite(r.get(key)) for r in rounds]


def compare_metric(vllm: Sequence[float | None], specbench: Sequence[float | None]) -> dict:
    """One figure, one level: both spreads, the paired ratios specbench / vllm, the noise floor, a verdict."""
    sv, ss = spread(vllm), spread(specbench)
    ratios = paired_ratios(dict(enumerate(vllm)), dict(enumerate(specbench)))
    ratio: dict | None = None if not ratios else {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                     "per_round": ratios}
    noise = None
    if sv is None and ss is None:
        verdict = "n/a"
    elif sv is None or ss is None or ratio is None:
        verdict = "missing"
    elif sv["noise"] is None or ss["noise"] is None:
        verdict = "no noise floor"
    else:
        noise = max(sv["noise"], ss["noise"])
        verdict = "within noise" if abs(ratio["median"] - 1.0) <= noise else "differs"
    return {"vllm": sv, "specbench": ss, "ratio": ratio, "noise": noise, "verdict": verdict}


def stream_check(rounds: Sequence[Mapping | None], k: int | None = None) -> dict:
    """One client, one level: acceptance length from the counters against what the stream shows."""
    c = spread(_figure(rounds, "acceptance_length"))
    s = spread(_figure(rounds, "stream_al"))
    bounds = [k * r["stream_requests"] / r["stream_gaps"] for r in rounds
              if k and r is not None and r.get("stream_gaps")]
    bound = statistics.median(bounds) if bounds else None
    out: dict[str, Any] = {"counters": c, "stream": s, "diff": None, "tolerance": None, "truncation_bound": bound,
                           "verdict": None}
    if c is None:
        out["verdict"] = "no counters"
        return out
    if s is None:
        out["verdict"] = "no stream lists"
        return out
    diff = c["median"] - s["median"]
    tol = max(c["noise"] or 0.0, s["noise"] or 0.0) * abs(c["median"])
    out.update(diff=diff, tolerance=tol)
    if abs(diff) <= tol:
        out["verdict"] = "equal within noise"
    elif bound is not None and -tol <= diff <= bound + tol:
        out["verdict"] = "explained: truncated last block"
    else:
        out["verdict"] = "differs"
    return out


def _levels(*sides: Mapping) -> list:
    return sorted({lv for side in sides for lv in side}, key=float)


def compare_clients(vllm: Mapping[Any, Sequence[Mapping | None]], specbench: Mapping[Any, Sequence[Mapping | None]],
                    k: int | None = None, metrics: Sequence[str] = COMPARED) -> dict:
    """Per level: every compared figure (`compare_metric`), each client's stream check, specbench's per-token
    ITL; and a count of verdicts over all levels and figures."""
    rows = []
    counts: dict[str, int] = {}
    for lv in _levels(vllm, specbench):
        v, s = list(vllm.get(lv) or []), list(specbench.get(lv) or [])
        row: dict[str, Any] = {"level": lv, "rounds": {"vllm": sum(r is not None for r in v),
                                                       "specbench": sum(r is not None for r in s)}, "metrics": {}}
        for m in metrics:
            cm = compare_metric(_figure(v, m), _figure(s, m))
            row["metrics"][m] = cm
            counts[cm["verdict"]] = counts.get(cm["verdict"], 0) + 1
        row["stream_check"] = {"vllm": stream_check(v, k), "specbench": stream_check(s, k)}
        row["itl_per_token_ms"] = {"vllm": spread(_figure(v, "itl_per_token_ms")),
                                   "specbench": spread(_figure(s, "itl_per_token_ms"))}
        rows.append(row)
    return {"ratio": "specbench / vllm (median of per-round ratios)",
            "noise_floor": "max of the two clients' (max - min) / median over rounds", "k": k, "levels": rows,
            "verdicts": counts}


# ---- markdown ----------------------------------------------------------------------------------------

def _f(v: Any, nd: int = 4) -> str:
    f = _finite(v)
    return "—" if f is None else f"{f:.{nd}g}"


def _pct(v: Any) -> str:
    f = _finite(v)
    return "—" if f is None else f"{100 * f:.1f} %"


def _sp(s: dict | None) -> str:
    if s is None:
        return "—"
    if s["rounds"] < 2:
        return _f(s["median"])
    return f"{_f(s['median'])} [{_f(s['min'])}, {_f(s['max'])}]"


def _lv(v: Any) -> str:
    f = _finite(v)
    return f"c{int(f)}" if f is not None and f == int(f) else f"c{v}"


def render_markdown(jobs: Sequence[Mapping[str, Any]], title: str = "specbench's client vs `vllm bench serve`") -> str:
    """Each job: {"tag", "server", "workload" (a line), "commands" (lines), "comparison" (compare_clients),
    optional "notes" (lines)}."""
    L = [f"# {title}", "",
         "Ratio = specbench / vLLM bench: the median over rounds of the per-round ratios (round r of specbench ran "
         "right after round r of vLLM bench, on the same server, at the same concurrency). Each client's noise "
         "floor is its own round-to-round spread, (max - min) / median; the verdict is **within noise** when "
         "|ratio - 1| is at most the larger of the two. Client columns: median [min, max] over rounds.", ""]
    for job in jobs:
        cmp_ = job.get("comparison") or {}
        L += [f"## {job.get('tag')}: {job.get('server')}", "", f"Workload: {job.get('workload')}", ""]
        if job.get("commands"):
            L += ["```bash", *job["commands"], "```", ""]
        for n in job.get("notes") or []:
            L.append(f"- {n}")
        if job.get("notes"):
            L.append("")
        L += ["| level | figure | vLLM bench | specbench | ratio [per-round min, max] | noise floor (vLLM / "
              "specbench) | verdict |", "|---|---|---:|---:|---:|---:|---|"]
        for row in cmp_.get("levels") or []:
            for m, cm in row["metrics"].items():
                if cm["verdict"] == "n/a":
                    continue
                r = cm["ratio"]
                rs = "—" if r is None else f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]"
                nv = (cm["vllm"] or {}).get("noise")
                ns = (cm["specbench"] or {}).get("noise")
                L.append(f"| {_lv(row['level'])} | {LABELS.get(m, m)} | {_sp(cm['vllm'])} | {_sp(cm['specbench'])} | "
                         f"{rs} | {_pct(nv)} / {_pct(ns)} | {cm['verdict']} |")
            pt = row["itl_per_token_ms"]["specbench"]
            if pt is not None:
                L.append(f"| {_lv(row['level'])} | ITL median, per token (ms) | — (not recorded) | {_sp(pt)} | — | — | "
                         "specbench only |")
        L.append("")
        checks = [(row["level"], c, row["stream_check"][c]) for row in cmp_.get("levels") or [] for c in CLIENTS
                  if row["stream_check"][c]["verdict"] != "no counters"]
        if checks:
            L += ["Acceptance, counters vs the stream (per client):", "",
                  "| level | client | AL counters | tokens per chunk gap (stream) | counters - stream | truncation "
                  "bound K x requests / gaps | verdict |", "|---|---|---:|---:|---:|---:|---|"]
            for lv, c, sc in checks:
                L.append(f"| {_lv(lv)} | {'vLLM bench' if c == 'vllm' else 'specbench'} | {_sp(sc['counters'])} | "
                         f"{_sp(sc['stream'])} | {_f(sc['diff'], 3)} | {_f(sc['truncation_bound'], 3)} | "
                         f"{sc['verdict']} |")
            L.append("")
        counts = cmp_.get("verdicts") or {}
        if counts:
            L += ["Verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k != "n/a"), ""]
    L += ["## Conventions", ""] + [f"- {c}" for c in CONVENTIONS] + [""]
    return "\n".join(L)
