"""vLLM's `vllm bench serve --save-result` JSON, both ways: a sweep cell out (`to_vllm`), a vLLM file in
(`from_vllm`).

The schema is vLLM's (vllm/benchmarks/serve.py: the `result` dict of `benchmark()` merged into
`main_async`'s `result_json`), written here from its field list, not its code:
- header: date (YYYYMMDD-HHMMSS), endpoint_type, backend, label, model_id, tokenizer_id, num_prompts,
  request_rate (a number, or the string "inf"), burstiness, max_concurrency;
- totals: duration (s), completed, failed, total_input_tokens, total_output_tokens, request_throughput
  (req/s), request_goodput (None: no SLOs), output_throughput and total_token_throughput (tok/s),
  max_output_tokens_per_s, max_concurrent_requests, rtfx (0.0);
- per request (what vLLM writes with --save-detailed; specbench always writes them): input_lens,
  output_lens, ttfts (s), itls (s, one list per request), latencies (s), start_times, queue_times (s),
  errors ("" on success). `generated_texts` is left out: a sweep does not keep output text;
- mean_/median_/std_<m>_ms and p50_/p90_/p99_<m>_ms for m in ttft, tpot, itl, e2el (ms; std is the
  population std, percentiles numpy-linear, an empty list counts as 0 as in vLLM);
- spec_decode_acceptance_rate (PERCENT), spec_decode_acceptance_length, spec_decode_num_drafts,
  spec_decode_draft_tokens, spec_decode_accepted_tokens, spec_decode_per_position_acceptance_rates
  (FRACTIONS per draft position), present only when there were draft tokens.

Units and conventions that differ from specbench's own records (docs/sweep.md has the conversions):
ITL here is vLLM's: the gap between consecutive streamed chunks, one entry per chunk (under
speculation a chunk carries about an acceptance length of tokens); specbench's per-token ITL spreads each
gap over that chunk's tokens and is under `specbench.itl_per_token_ms`. Acceptance rate here is a
percentage; specbench's own is a fraction. A failed request has ttft, latency 0.0 and output_len 0 with
its error, as in vLLM. start_times are epoch seconds (vLLM's are its perf_counter). Latencies start at the
first send of a request's first attempt. max_output_tokens_per_s counts tokens (vLLM counts one per
chunk). Everything specbench adds is under the one key `specbench` (run, arm, level, round, per-token
ITL, acceptance as a fraction and its source, attempts and retries, token counting method).

`from_vllm(obj)` reads such a file (from vLLM or from specbench) into a cell: vLLM's aggregate figures
as specbench cell stats (seconds; vLLM's ITL becomes the raw chunk gap, the per-token ITL is unknown
unless the file is specbench's), the spec-decode fields as a counter delta, and per-request records when
the per-request lists are present. A missing required field raises `VllmFormatError` naming it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .metrics import acceptance, derive

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
REQUIRED = ("duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "mean_ttft_ms", "median_ttft_ms")


class VllmFormatError(ValueError):
    """A file that is not a `vllm bench serve` result; the message names the file and the field."""


def _ms_stats(values: Sequence[float], name: str) -> dict[str, float]:
    v = np.asarray(list(values) or [0.0], dtype=float)  # vLLM: np.mean(x or 0)
    out = {f"mean_{name}_ms": float(v.mean() * 1e3), f"median_{name}_ms": float(np.median(v) * 1e3),
           f"std_{name}_ms": float(v.std() * 1e3)}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(v, p) * 1e3)
    return out


def _peaks(reqs: Sequence[dict], derived: Sequence[dict]) -> tuple[float, int]:
    """(max output tokens in any 1 s bucket from the first send, peak requests in flight)."""
    ok = [(r, d) for r, d in zip(reqs, derived, strict=True) if d["ok"] and r.get("wall_send") is not None
          and d["e2el"] is not None]
    if not ok:
        return 0.0, 0
    t0 = min(r["wall_send"] for r, _ in ok)
    end = max(r["wall_send"] + d["e2el"] for r, d in ok)
    buckets = np.zeros(int(math.ceil(end - t0)) + 1)
    events: list[tuple[float, int]] = []
    for r, d in ok:
        for off, n in zip(r.get("chunk_offsets") or [], d["counts"], strict=False):
            b = int(r["wall_send"] - t0 + off)
            if 0 <= b < len(buckets):
                buckets[b] += n
        events += [(r["wall_send"], 1), (r["wall_send"] + d["e2el"], -1)]
    events.sort()
    cur = peak = 0
    for _, dlt in events:
        cur += dlt
        peak = max(peak, cur)
    return float(buckets.max()), peak


def to_vllm(requests: Sequence[dict], cell: dict, *, label: str, model_id: str | None, backend: str,
            num_prompts: int, request_rate: float | None, burstiness: float, max_concurrency: int | None,
            extras: dict | None = None, date: str | None = None) -> dict:
    """One cell's request records (as stored) and cell record -> vLLM's result dict (module docstring)."""
    derived = [derive(r) for r in requests]
    for r, d in zip(requests, derived, strict=True):
        d["counts"] = _counts(r, d)
    ok = [(r, d) for r, d in zip(requests, derived, strict=True) if d["ok"]]
    duration = float(cell.get("duration") or 0.0)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out_lens = [d["output_tokens"] if d["ok"] else 0 for d in derived]
    total_in = sum(int(r.get("prompt_tokens") or 0) for r, _ in ok)
    total_out = sum(out_lens)
    peak_tok, peak_conc = _peaks(requests, derived)
    res: dict[str, Any] = {
        "date": date or time.strftime("%Y%m%d-%H%M%S", time.localtime(cell.get("wall_start") or time.time())),
        "endpoint_type": backend, "backend": backend, "label": label, "model_id": model_id, "tokenizer_id": model_id,
        "num_prompts": num_prompts,
        "request_rate": "inf" if request_rate is None or math.isinf(request_rate) else request_rate,
        "burstiness": burstiness, "max_concurrency": max_concurrency,
        "duration": duration, "completed": len(ok), "failed": len(requests) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)), "request_goodput": None, "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
        "input_lens": [int(r.get("prompt_tokens") or 0) for r in requests], "output_lens": out_lens,
        "ttfts": [d["ttft"] if d["ok"] and d["ttft"] is not None else 0.0 for d in derived],
        "itls": [list(d["chunk_gaps"]) if d["ok"] else [] for d in derived],
        "latencies": [d["e2el"] if d["ok"] and d["e2el"] is not None else 0.0 for d in derived],
        "start_times": [r.get("wall_send") or 0.0 for r in requests],
        "queue_times": [float((r.get("meta") or {}).get("queue_time") or 0.0) for r in requests],
        "errors": ["" if d["ok"] else str(r.get("error") or "failed") for r, d in zip(requests, derived, strict=True)],
        "max_output_tokens_per_s": peak_tok, "max_concurrent_requests": peak_conc, "rtfx": 0.0,
    }
    acc = acceptance(requests, cell.get("counters"))
    if acc and acc.get("num_draft_tokens"):
        res.update({
            "spec_decode_acceptance_rate": acc["num_accepted_tokens"] / acc["num_draft_tokens"] * 100.0,
            "spec_decode_acceptance_length": acc["length"], "spec_decode_num_drafts": int(acc["num_drafts"]),
            "spec_decode_draft_tokens": int(acc["num_draft_tokens"]),
            "spec_decode_accepted_tokens": int(acc["num_accepted_tokens"]),
            "spec_decode_per_position_acceptance_rates": list(acc["per_pos"]),
        })
    res.update(_ms_stats([d["ttft"] for _, d in ok if d["ttft"] is not None], "ttft"))
    res.update(_ms_stats([d["tpot"] for _, d in ok if d["tpot"] is not None], "tpot"))
    res.update(_ms_stats([g for _, d in ok for g in d["chunk_gaps"]], "itl"))
    res.update(_ms_stats([d["e2el"] for _, d in ok if d["e2el"] is not None], "e2el"))
    per_token = _ms_stats([x for _, d in ok for x in d["itls"]], "itl")
    attempts = [int(r.get("attempts") or 1) for r in requests]
    res["specbench"] = {
        "format": 1, **(extras or {}),
        "itl_convention": "itls / *_itl_ms: per streamed chunk (vLLM); per-token: itl_per_token_ms",
        "itl_per_token_ms": {k.replace("_itl_ms", ""): v for k, v in per_token.items()},
        "acceptance": None if acc is None else {"source": acc["source"], "rate_fraction": acc["rate"],
                                                "length": acc["length"],
                                                "length_request_mean": acc["length_request_mean"]},
        "attempts": attempts, "retried": sum(1 for a in attempts if a > 1),
        "extra_attempts": sum(a - 1 for a in attempts),
        "token_count_methods": sorted({str(r.get("token_count_method")) for r in requests}),
    }
    return res


def _counts(rec: dict, d: dict) -> list[int]:
    from .metrics import reconcile_chunks

    if not d["ok"]:
        return []
    times = rec.get("chunk_offsets") or []
    return reconcile_chunks(rec.get("chunk_tokens") or [1] * len(times), d["output_tokens"])


# ---- in ------------------------------------------------------------------------------------------
def _num(obj: dict, key: str, where: str) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise VllmFormatError(f"{where}: field {key!r} is {v!r}: expected a number (is this a `vllm bench serve "
                              "--save-result` file?)")
    return float(v)


def _stat(obj: dict, name: str, n: int) -> dict:
    def ms(key: str) -> float | None:
        v = obj.get(key)
        return None if v is None or isinstance(v, bool) else float(v) / 1e3

    if obj.get(f"mean_{name}_ms") is None:
        return {"n": 0, "mean": None, "median": None, "p90": None, "p99": None}
    return {"n": n, "mean": ms(f"mean_{name}_ms"), "median": ms(f"median_{name}_ms") or ms(f"p50_{name}_ms"),
            "p90": ms(f"p90_{name}_ms"), "p99": ms(f"p99_{name}_ms")}


def from_vllm(obj: Any, where: str = "file") -> dict:
    """A vLLM result dict -> {label, model_id, level, level_kind, stats, counters, requests, header}."""
    if not isinstance(obj, dict):
        raise VllmFormatError(f"{where}: expected one JSON object (a `vllm bench serve --save-result` file), got "
                              f"{type(obj).__name__}")
    for k in REQUIRED:
        _num(obj, k, where)
    rr = obj.get("request_rate", "inf")
    rate = math.inf if rr in ("inf", None) else float(rr)
    mc = obj.get("max_concurrency")
    if math.isinf(rate):
        if mc is None:
            level, kind = math.inf, "rate"  # everything at once, no cap: vLLM's default
        else:
            level, kind = float(mc), "concurrency"
    else:
        level, kind = rate, "rate"
    completed, failed = int(obj["completed"]), int(obj.get("failed") or 0)
    dur = _num(obj, "duration", where)
    sb = obj.get("specbench") if isinstance(obj.get("specbench"), dict) else None
    stats: dict[str, Any] = {
        "requests": completed + failed, "completed": completed, "failed": failed, "duration": dur,
        "output_tokens": int(obj["total_output_tokens"]), "input_tokens": int(obj["total_input_tokens"]),
        "output_tok_s": float(obj["output_throughput"]), "req_s": float(obj["request_throughput"]),
        "total_tok_s": float(obj.get("total_token_throughput") or 0.0),
        "ttft": _stat(obj, "ttft", completed), "tpot": _stat(obj, "tpot", completed),
        "e2el": _stat(obj, "e2el", completed), "chunk_gap": _stat(obj, "itl", completed),
        "itl": {"n": 0, "mean": None, "median": None, "p90": None, "p99": None},
    }
    if sb and isinstance(sb.get("itl_per_token_ms"), dict):  # specbench's own file: the per-token ITL is known
        t = sb["itl_per_token_ms"]
        stats["itl"] = {"n": completed, **{k: (t.get(k) / 1e3 if t.get(k) is not None else None)
                                           for k in ("mean", "median", "p90", "p99")}}
    counters = None
    if obj.get("spec_decode_num_drafts") is not None:
        drafts = int(obj["spec_decode_num_drafts"])
        per_pos = [round(float(x) * drafts) for x in obj.get("spec_decode_per_position_acceptance_rates") or []]
        counters = {"source": "vllm-bench", "num_drafts": drafts,
                    "num_draft_tokens": int(obj.get("spec_decode_draft_tokens") or 0),
                    "num_accepted_tokens": int(obj.get("spec_decode_accepted_tokens") or 0),
                    "accepted_per_pos": per_pos}
    header = {k: obj.get(k) for k in ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id",
                                      "num_prompts", "request_rate", "burstiness", "max_concurrency")}
    return {"label": obj.get("label") or obj.get("backend") or "vllm-bench", "model_id": obj.get("model_id"),
            "level": level, "level_kind": kind, "stats": stats, "counters": counters,
            "requests": _requests(obj, where), "header": header}


def _requests(obj: dict, where: str) -> list[dict]:
    """Per-request records from the per-request lists (vLLM --save-detailed), else none. vLLM does not
    record tokens per chunk, so the output tokens are spread evenly over the chunks (labelled)."""
    ttfts, itls, lats = obj.get("ttfts"), obj.get("itls"), obj.get("latencies")
    if not (isinstance(ttfts, list) and isinstance(itls, list) and isinstance(lats, list)):
        return []
    n = len(ttfts)
    if len(itls) != n or len(lats) != n:
        raise VllmFormatError(f"{where}: ttfts, itls and latencies have {n}, {len(itls)}, {len(lats)} entries: "
                              "expected one per request")
    outs = obj.get("output_lens") or [None] * n
    ins = obj.get("input_lens") or [None] * n
    errs = obj.get("errors") or [""] * n
    starts = obj.get("start_times") or [0.0] * n
    out = []
    for i in range(n):
        ok = not errs[i]
        gaps = [float(g) for g in itls[i] or []]
        offs = [float(ttfts[i])]
        for g in gaps:
            offs.append(offs[-1] + g)
        tokens = outs[i] if outs[i] is not None else len(offs)
        base, extra = divmod(int(tokens), len(offs))
        counts = [base + (1 if j < extra else 0) for j in range(len(offs))]
        out.append({"rid": f"vllm-{i}", "ok": ok, "error": errs[i] or None, "prompt_tokens": ins[i],
                    "completion_tokens": outs[i] if ok else None, "wall_send": float(starts[i] or 0.0),
                    "ttft": float(ttfts[i]) if ok else None, "e2el": float(lats[i]) if ok else None,
                    "chunk_offsets": offs if ok else [], "chunk_tokens": counts if ok else [],
                    "token_count_method": "even (vLLM bench records no tokens per chunk)", "attempts": 1,
                    "spec": None})
    return out
