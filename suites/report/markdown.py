"""Markdown A/B tables from `RunSummary`s: rows are load levels, columns are arms.

Contract: pure text from summaries. Per run: the arms (engine strings), throughput (median over
rounds) with each arm's speedup over the baseline as the median paired ratio [min-max over rounds] and
the paired noise floor; TPOT, TTFT, per-token ITL and raw chunk gaps; acceptance (rate, token-weighted
and request-mean length, labelled by source); per-position acceptance per spec arm; request counts.
A speedup within the noise floor is marked "~" (not resolved). Several runs: each gets its section, then
one table compares every run's arms (unpaired: different sessions, so no noise floor applies).
"""

from __future__ import annotations

import time

from specbench.harness.verdicts import PASS
from specbench.suites.sweep.metrics import broke_lockstep

from .summarize import RunSummary


def _lv(s: RunSummary, lv: float) -> str:
    return f"c{int(lv)}" if s.level_kind == "concurrency" else (f"{lv:g} req/s" if lv != float("inf") else "inf")


def _f(x: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if x is None else fmt.format(x)


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    align = ["---"] * left + ["---:"] * (len(header) - left)
    return ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"] + \
        ["| " + " | ".join(r) + " |" for r in rows]


def speedup_cell(sp: dict | None, nf: dict | None) -> str:
    if sp is None:
        return "—"
    mark = "~" if nf is not None and abs(sp["median"] - 1.0) <= nf["noise"] else ""
    rng = f" [{sp['min']:.2f}–{sp['max']:.2f}]" if sp["rounds"] > 1 else ""
    return f"{mark}{sp['median']:.2f}×{rng}"


def noise_cell(nf: dict | None) -> str:
    if nf is None:
        return "—"
    return f"±{nf['noise'] * 100:.1f}% (A'/A {nf['median_ratio']:.3f})"


def run_header(s: RunSummary) -> list[str]:
    cfg = s.meta.get("config", {})
    wl = s.meta.get("workload", {})
    loop = "closed loop (C requests in flight)" if s.level_kind == "concurrency" else \
        f"open loop ({cfg.get('arrival')} arrivals, burstiness {cfg.get('burstiness')})"
    started = s.meta.get("started")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(started)) if isinstance(started, int | float) else \
        (started or "—")
    if s.meta.get("source") == "vllm-bench":  # an import: the workload and sampling are vLLM bench's own
        setup = (f"- {loop}; a `vllm bench serve` run: {wl.get('kept', '?')} prompts per file, its own data set and "
                 "sampling (not recorded in its result file); one file per cell")
    else:
        setup = (f"- {loop}; dataset **{wl.get('dataset', cfg.get('dataset'))}** ({wl.get('kept', '?')} prompts kept, "
                 f"seed {cfg.get('seed')}); max_tokens {cfg.get('max_tokens')}"
                 f"{' (ignore_eos)' if cfg.get('ignore_eos') else ''}; temperature {cfg.get('temperature')}; "
                 f"{cfg.get('rounds')} interleaved rounds; {cfg.get('warmup')} warm-up wave(s) per engine and level "
                 "(excluded)" + ("; chat endpoint (the server's chat template)" if cfg.get("endpoint_type") == "chat"
                                 else ""))
    lines = [f"## Run `{s.run_id}`", "", setup,
             f"- started {when}; git {s.meta.get('git_sha') or '—'}; device {s.meta.get('device') or '—'}"
             + ("" if s.complete else "; **INCOMPLETE run (interrupted): figures cover the cells that finished**")]
    req = s.meta.get("requests") if isinstance(s.meta.get("requests"), dict) else None
    if req and (req.get("failed") or req.get("retried")):
        lines.append(f"- requests: {req['requests']} measured, **{req.get('failed', 0)} FAILED**, "
                     f"{req.get('retried', 0)} retried ({req.get('extra_attempts', 0)} extra attempts); failed requests "
                     "are in no latency or throughput figure, retried ones count from their first send")
    if s.meta.get("source") == "vllm-bench":
        lines.append(f"- imported from `vllm bench serve` result files: {', '.join(s.meta.get('files') or [])}; "
                     "ITL there is per streamed chunk (shown as raw chunk gaps), acceptance from its spec-decode "
                     "counters")
    if s.baseline:
        nf = f"; noise floor: `{s.noise_arm}` is `{s.baseline}` run again, interleaved" if s.noise_arm else ""
        lines.append(f"- baseline arm: `{s.baseline}`{nf}")
    lines += ["", *_table(["arm", "engine", "model / config"],
                          [[f"`{a['label']}`", f"`{a.get('engine') or '—'}`", _desc(a.get("description"))]
                           for a in s.arms], left=3)]
    return lines


def _desc(d: dict | None) -> str:
    if not d:
        return "—"
    config = d.get("config")
    c = config if isinstance(config, dict) else {}
    bits = [str(d.get("model") or "")]
    for k in ("spec", "k", "dtype", "device"):
        if c.get(k) not in (None, "", 0):
            bits.append(f"{k}={c[k]}")
    if c.get("synthetic_tau") is not None:
        bits.append(f"**synthetic acceptance tau={c['synthetic_tau']}** (drawn, not measured)")
    return " ".join(b for b in bits if b).replace("|", "/") or "—"


def throughput_table(s: RunSummary) -> list[str]:
    arms = s.compared_arms
    others = [a for a in arms if a != s.baseline]
    header = [s.level_kind] + [f"{a} tok/s" for a in arms] + [f"{a} vs {s.baseline}" for a in others] + \
        ["noise floor"] + [f"{a} req/s" for a in arms]
    rows = []
    for lv in s.levels:
        r = [_lv(s, lv)]
        r += [_f(c.tok_s_median if (c := s.get(a, lv)) else None) for a in arms]
        r += [speedup_cell(s.speedups.get((a, lv)), s.noise.get(lv)) for a in others]
        r.append(noise_cell(s.noise.get(lv)))
        r += [_f(c.req_s_median if (c := s.get(a, lv)) else None, "{:.2f}") for a in arms]
        rows.append(r)
    return _table(header, rows)


def latency_table(s: RunSummary, metric: str, title: str) -> list[str]:
    arms = s.compared_arms
    rows = []
    for lv in s.levels:
        r = [_lv(s, lv)]
        for a in arms:
            c = s.get(a, lv)
            st = c.stats[metric] if c else None
            r.append("—" if not st or st["n"] == 0 else f"{_ms(st['mean'])} / {_ms(st['median'])} / {_ms(st['p90'])} / "
                     f"{_ms(st['p99'])}")
        rows.append(r)
    return [f"#### {title} (ms: mean / median / p90 / p99)", "", *_table([s.level_kind, *arms], rows)]


def synthetic_tau(s: RunSummary, arm: str) -> float | None:
    """The synthetic acceptance length an arm's engine drew its accepts from, if any."""
    for a in s.arms:
        if a["label"] == arm:
            c = (a.get("description") or {}).get("config")
            return c.get("synthetic_tau") if isinstance(c, dict) else None
    return None


def acceptance_table(s: RunSummary) -> list[str]:
    arms = s.spec_arms
    if not arms:
        return ["No arm reported speculative-decoding counts (spec off everywhere)."]
    header = [s.level_kind]
    for a in arms:
        header += [f"{a} rate", f"{a} AL tok-w", f"{a} AL req-mean", f"{a} source"]
    rows = []
    for lv in s.levels:
        r = [_lv(s, lv)]
        for a in arms:
            c = s.get(a, lv)
            acc = c.acceptance if c else None
            if acc is None:
                r += ["—"] * 4
                continue
            src = {"request": "per-request", "vllm-bench": "vLLM bench (counters, server-wide)",
                   "counters-c1": "counter deltas per request at c1"}.get(acc["source"], "counters (server-wide)")
            tau = synthetic_tau(s, a)
            r += [_f(acc["rate"] * 100 if acc["rate"] is not None else None, "{:.1f}%"), _f(acc["length"], "{:.3f}"),
                  _f(acc["length_request_mean"], "{:.3f}"), src if tau is None else f"{src}, SYNTHETIC tau={tau}"]
        rows.append(r)
    return _table(header, rows)


def per_position_tables(s: RunSummary) -> list[str]:
    out: list[str] = []
    for a in s.spec_arms:
        accs = {lv: c.acceptance for lv in s.levels if (c := s.get(a, lv)) and c.acceptance}
        width = max((len(x["per_pos"]) for x in accs.values()), default=0)
        if not width:
            continue
        rows = [[_lv(s, lv)] + [f"{p * 100:.1f}%" for p in accs[lv]["per_pos"]] + ["—"] * (width - len(accs[lv]["per_pos"]))
                for lv in s.levels if lv in accs]
        out += [f"#### Per-position acceptance: `{a}` (accepted at draft position i / verify steps)", "",
                *_table([s.level_kind] + [f"pos {i + 1}" for i in range(width)], rows), ""]
    return out


def counts_table(s: RunSummary) -> list[str]:
    rows = []
    for lv in s.levels:
        for a in [x["label"] for x in s.arms]:
            c = s.get(a, lv)
            if c is None:
                continue
            st = c.stats
            busy = c.client_busy
            load = "—" if busy is None else f"{busy * 100:.0f}%" + (" **SATURATED**" if c.client_saturated else "")
            rows.append([_lv(s, lv), f"`{a}`", str(len(c.tok_s)), str(st["completed"]), str(st["failed"]),
                         str(st["input_tokens"]), str(st["output_tokens"]),
                         " ".join(_f(c.tok_s[r]) for r in sorted(c.tok_s)), load])
    return _table([s.level_kind, "arm", "rounds", "completed", "failed", "input tokens", "output tokens",
                   "tok/s per round", "client busy (max)"], rows, left=2)


def render_run(s: RunSummary, images: dict[str, str] | None = None) -> list[str]:
    lines = [*run_header(s), "", f"### Output throughput (tok/s, median over {s.meta.get('config', {}).get('rounds')} "
             "interleaved rounds)", "",
             "Speedup = median over rounds of the paired per-round ratio arm/baseline [min–max]; noise floor = "
             "median |A'/A − 1| of the baseline against its interleaved copy; `~` = within the noise floor.", "",
             *throughput_table(s), "", *lockstep_note(s)]
    for key, title in (("tok_s", "tok/s vs load"), ("speedup", "speedup with its noise band")):
        if images and key in images:
            lines += [f"![{title}]({images[key]})", ""]
    lines += ["### Latency", "", *latency_table(s, "tpot", "TPOT"), ""]
    if images and "tpot" in images:
        lines += [f"![TPOT vs load]({images['tpot']})", ""]
    lines += [*latency_table(s, "ttft", "TTFT"), "", *latency_table(s, "itl", "Per-token ITL (chunk gaps spread over "
                                                                          "their tokens)"), "",
              *latency_table(s, "chunk_gap", "Raw chunk gaps"), "", *latency_table(s, "e2el", "E2EL"), "",
              "### Acceptance", "",
              "rate = accepted / draft tokens; AL tok-w = 1 + accepted / verify steps (pooled); AL req-mean = mean "
              "of each request's own length.", "", *acceptance_table(s), "", *per_position_tables(s)]
    if images and "acceptance" in images:
        lines += [f"![acceptance per position]({images['acceptance']})", ""]
    lines += ["### Requests", "", *counts_table(s), ""]
    lines += audit_section(s) + capability_section(s)
    return lines


def lockstep_note(s: RunSummary) -> list[str]:
    """Where the baseline ran in lockstep waves (requests of one length that started together finishing together,
    their successors' prefills sharing a step) and an arm spread its finishes (each arrival's prefill a step of its
    own), the speedup at that level measures the lockstep as much as the arm: say so, with the figures."""
    if s.level_kind != "concurrency" or not s.baseline:
        return []
    hits = []
    for lv in s.levels:
        b = s.get(s.baseline, lv)
        for a in s.compared_arms:
            c = s.get(a, lv)
            if a != s.baseline and b is not None and c is not None and \
                    broke_lockstep(lv, b.finish_groups, c.finish_groups):
                hits.append(f"c{lv:g} `{a}` {c.finish_groups:.2f} vs `{s.baseline}` {b.finish_groups:.2f}")
    if not hits:
        return []
    return ["**Lockstep:** the baseline's requests finished in waves (finish groups per request, requests ending in "
            "one engine step counted once: " + "; ".join(hits) + "). Requests of one length that start together "
            "finish together and their successors' prefills share a step, which the baseline profits from and an arm "
            "whose requests progress unevenly (speculation) does not: those speedups measure the lockstep as much "
            "as the arm. Lengths that differ (`--max-tokens-spread 0.5`, or a data set without `--ignore-eos`) "
            "measure without it (docs/sweep.md).", ""]


def audit_section(s: RunSummary) -> list[str]:
    """The acceptance / metrics audit: which checks ran per arm, which could not and why."""
    a = s.audit
    if not a:
        return []
    rows = [[f"`{x['arm']}`", x["verdict"] if x["verdict"] == PASS else f"**{x['verdict']}**",
             ", ".join(x["sources"]) or "none", "; ".join(x["checks"]) or "none",
             "; ".join(x["problems"][:3]) or x.get("missing") or "-"] for x in a["arms"]]
    out = [f"### Acceptance / metrics audit: {a['verdict']}", "",
           "Counter invariants per cell (per-position sums = accepted, non-increasing, accepted <= draft tokens "
           "<= K x drafts) and, where every request carries its own counts, their sums against the counter "
           "delta; the client-side audit of /metrics (request and token counters vs what the client received, "
           "spec counters vs output tokens and tokens per streamed chunk, gauges stale after a cell). CANNOT TEST "
           "= neither counters nor per-request counts, or cells whose counters could not be attributed to them "
           "(another client's traffic, counters that never settled; named, not judged): the acceptance figures "
           "above are unverified there.", "",
           *_table(["arm", "verdict", "evidence", "checks run", "problems / missing"], rows, left=5)]
    return out + [""]


def capability_section(s: RunSummary) -> list[str]:
    """The endpoint capability records of the arms that have one (openai engines, adapters/dialect.py)."""
    found = [(a["label"], (a.get("description") or {}).get("capabilities")) for a in s.arms if not a.get("copy_of")]
    caps = [(label, c) for label, c in found if isinstance(c, dict)]
    if not caps:
        return []
    keys = ("dialect", "tokenize", "generate_route", "output_ids", "logprobs", "top_logprobs", "prompt_logprobs",
            "usage", "metrics_prefix", "per_request_spec", "prompt_cache", "speculated_logprobs", "missing")
    rows = [[k, *[_cap(c.get(k)) for _, c in caps]] for k in keys]
    rows.insert(1, ["version / build", *[_cap((c.get("server") or {}).get("version")) for _, c in caps]])
    return ["### Endpoint capabilities", "", *_table(["capability", *[f"`{label}`" for label, _ in caps]], rows,
                                                      left=len(caps) + 1), ""]


def _cap(v: object) -> str:
    if v is None:
        return "—"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "none"
    return str(v).lower() if isinstance(v, bool) else str(v)


def render_comparison(runs: list[RunSummary]) -> list[str]:
    """tok/s of every run's arms side by side, with each arm's ratio to the same-named arm of the first run."""
    first = runs[0]
    cols = [(s, a) for s in runs for a in s.compared_arms]
    levels = sorted({lv for s in runs for lv in s.levels})
    header = [first.level_kind] + [f"{s.run_id}/{a} tok/s" for s, a in cols] + \
        [f"{s.run_id}/{a} vs {first.run_id}" for s, a in cols if s is not first and a in first.compared_arms]
    rows = []
    for lv in levels:
        r = [_lv(first, lv)]
        r += [_f(c.tok_s_median if (c := s.get(a, lv)) else None) for s, a in cols]
        for s, a in cols:
            if s is first or a not in first.compared_arms:
                continue
            x, y = first.get(a, lv), s.get(a, lv)
            ok = x and y and x.tok_s_median and y.tok_s_median
            r.append(f"{y.tok_s_median / x.tok_s_median:.2f}×" if ok else "—")  # type: ignore[union-attr,operator]
        rows.append(r)
    return ["## Runs compared", "",
            "Unpaired: runs come from different sessions, so their ratios carry no paired noise floor; "
            "read them against each run's own noise floor below.", "", *_table(header, rows), ""]
