"""Prometheus text parsing and the speculative-decoding counters engines publish.

Contract: `parse_prometheus(text)` returns every sample as (name, labels, value); comments, blank
lines and malformed lines are skipped, never fatal. `spec_counters_from_metrics(text, model=None)`
reads vLLM's counters (summed over label sets such as engine index; restricted to `model_name=model`
when that label is present and matches anything) and SGLang's accept-length gauges:
  vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
  vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
  sglang:spec_accept_length (and any other sglang:spec_* gauge, kept under "gauges").
llama.cpp publishes the same four counters under its own prefix (`llamacpp:spec_decode_...`; its
num_drafts counts verification steps, like vLLM's); they are read the same way. The result carries
`prefix` ("vllm:" or "llamacpp:") so records say where the numbers came from. A text with counters of
both prefixes (a proxy in front of two engines) is refused (None): the two cannot be summed.
It returns None when the text has none of them.
"""

from __future__ import annotations

import math
import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')

PREFIXES = ("vllm:", "llamacpp:")
VLLM = "vllm:spec_decode_"
SUFFIXES = {"num_drafts": "spec_decode_num_drafts_total", "num_draft_tokens": "spec_decode_num_draft_tokens_total",
            "num_accepted_tokens": "spec_decode_num_accepted_tokens_total"}
PER_POS_SUFFIX = "spec_decode_num_accepted_tokens_per_pos_total"
COUNTERS = {k: "vllm:" + v for k, v in SUFFIXES.items()}
PER_POS = "vllm:" + PER_POS_SUFFIX


def _split(name: str) -> tuple[str, str] | None:
    for p in PREFIXES:
        if name.startswith(p):
            return p, name[len(p):]
    return None


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m.group(3) or "")}
        out.append((m.group(1), labels, value))
    return out


def _num(v: float) -> int | float:
    return int(v) if math.isfinite(v) and float(v).is_integer() else v


def spec_counters_from_metrics(text: str, model: str | None = None) -> dict | None:
    samples = parse_prometheus(text)
    if model is not None:
        # Only filter when the server labels samples with this model; otherwise keep everything.
        mine = [s for s in samples if s[1].get("model_name") in (None, model)]
        if any(s[1].get("model_name") == model for s in samples):
            samples = mine
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    gauges: dict[str, float] = {}
    prefixes: set[str] = set()
    found = False
    for name, labels, value in samples:
        sp = _split(name)
        if sp is not None and sp[1] == PER_POS_SUFFIX and "position" in labels:
            try:
                pos = int(labels["position"])
            except ValueError:
                continue
            per_pos[pos] = per_pos.get(pos, 0.0) + value
            prefixes.add(sp[0])
            found = True
        elif sp is not None and sp[1] in SUFFIXES.values():
            sums[sp[1]] = sums.get(sp[1], 0.0) + value
            prefixes.add(sp[0])
            found = True
        elif name.startswith("sglang:spec_"):
            gauges[name] = value
            found = True
    if not found or len(prefixes) > 1:
        return None
    out: dict = {k: (_num(sums[n]) if n in sums else None) for k, n in SUFFIXES.items()}
    if prefixes:
        out["prefix"] = next(iter(prefixes))
    n = max(per_pos) + 1 if per_pos else 0
    out["accepted_per_pos"] = [_num(per_pos.get(i, 0.0)) for i in range(n)]
    if gauges:
        out["gauges"] = gauges
        if "sglang:spec_accept_length" in gauges:
            out["accept_length"] = gauges["sglang:spec_accept_length"]
    # `specbench serve`'s load-aware speculation counters (engine/spec/policy.py): one-token rounds, steps per span
    spans = {labels["span"]: _num(v) for name, labels, v in samples
             if name == "specbench:spec_step_span_total" and "span" in labels}
    if spans:
        out["span_hist"] = dict(sorted(spans.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0))
    gated = [v for name, _, v in samples if name == "specbench:spec_gated_rounds_total"]
    if gated:
        out["gated_rounds"] = _num(sum(gated))
    out["source"] = "metrics"
    return out
