"""Prefix caching with the drafter on: a multi-turn workload behind a shared prefix, cache on vs off.

Workload: --conversations conversations, each `shared prefix (--prefix-tokens ids) + its own gsm8k question`;
turn t + 1 is turn t's prompt + its output + a follow-up question; every turn of every conversation is
greedy with ignore_eos and --max-tokens tokens, the conversations of one turn submitted together (the engine
batches them). Before turn 1 one priming request computes the shared prefix alone (a system prompt already
served), so turn 1 is warm for the prefix and turns 2.. are warm for the whole earlier conversation.
Two engines of the same pair: "on" (the default: prefix cache on, the drafter's capture restored on a hit)
and "off" (`prefix_cache=False`); --rounds rounds alternate the arms, the "on" engine's cache flushed at each
round's start. Per arm and turn: TTFT (median and p90 over the turn's requests; engine clock, arrival to first
token), throughput (output tokens / the turn's wall time), tokens served from the cache, acceptance length
(1 + accepted / drafts over the turn) and fallbacks (hits that decoded without drafts). The warm-vs-cold
ratios are medians over rounds; the noise floor is the spread of the "off" arm between rounds.
--tau T: synthetic acceptance (engine/spec/synthetic.py) for speed on random weights (the Qwen3-4B-shaped
pair): labelled, and acceptance then says only that the drafter was ready (a fallback still drafts nothing).

Usage: python -m specbench.benchmarks.prefix [--target DIR --draft DIR] [--device cuda] [--dtype bfloat16]
       [--prefix-tokens 1000] [--conversations 8] [--turns 3] [--max-tokens 64] [--rounds 2] [--tau T]
       [--out JSON] [--report MD]
Prints a table per arm, then one JSON document as the last stdout line.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from specbench.engine import LLM, SamplingParams
from specbench.harness.benchdoc import emit_document
from specbench.harness.datasets import bundled_prompts

SHARED = ("You are a careful assistant for grade-school mathematics. Read each question twice, write down the "
          "quantities it gives, reason one step at a time, check every calculation, and end with the answer on its "
          "own line. ")
FOLLOW_UP = "\nQuestion: Now double that result and explain the step.\nAnswer:"


def shared_prefix(tok, n: int) -> list[int]:
    ids: list[int] = []
    piece = tok.encode(SHARED)
    while len(ids) < n:
        ids += piece
    return ids[:n]


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def run_arm(llm: LLM, prefix: list[int], questions: list[list[int]], follow: list[int], turns: int,
            max_tokens: int) -> list[dict]:
    """One pass of the workload on one engine: per turn, its figures."""
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.engine.reset_prefix_cache()
    llm.generate([prefix + follow], SamplingParams(max_tokens=1, ignore_eos=True))  # the shared prefix, primed
    prompts = [prefix + q for q in questions]
    out = []
    for t in range(1, turns + 1):
        m0 = llm.engine.metrics.snapshot()
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
        m1 = llm.engine.metrics.snapshot()
        ttft = [r.ttft for r in res if r.ttft is not None]
        drafts = sum(r.spec.get("num_drafts", 0) for r in res)
        acc = sum(r.spec.get("num_accepted_tokens", 0) for r in res)
        toks = sum(len(r.output_ids) for r in res)
        out.append({"turn": t, "requests": len(res), "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
                    "ttft_median_s": statistics.median(ttft) if ttft else None, "ttft_p90_s": percentile(ttft, 0.9),
                    "wall_s": wall, "tok_s": toks / wall if wall > 0 else None, "output_tokens": toks,
                    "cached_tokens_mean": statistics.mean(r.spec.get("cached_tokens", 0) for r in res),
                    "accept_len": 1.0 + acc / drafts if drafts else None, "drafts": drafts,
                    "fallbacks": sum(1 for r in res if r.spec.get("capture_fallback")),
                    "prefix_hits": m1["prefix_hits"] - m0["prefix_hits"],
                    "prefix_queries": m1["prefix_queries"] - m0["prefix_queries"]})
        prompts = [p + list(r.output_ids) + follow for p, r in zip(prompts, res, strict=True)]
    return out


def summarize(rounds: list[dict[str, list[dict]]], turns: int) -> list[dict]:
    """Per turn: the medians over rounds of each arm's TTFT and tok/s, the on/off ratios, the noise floor."""
    rows = []
    for t in range(turns):
        row: dict = {"turn": t + 1}
        for arm in ("on", "off"):
            cells = [r[arm][t] for r in rounds if arm in r]
            for k in ("ttft_median_s", "tok_s", "accept_len", "cached_tokens_mean", "fallbacks"):
                vals = [c[k] for c in cells if c.get(k) is not None]
                row[f"{arm}_{k}"] = statistics.median(vals) if vals else None
        ratios = [(r["off"][t]["ttft_median_s"] / r["on"][t]["ttft_median_s"], r["on"][t]["tok_s"] / r["off"][t]["tok_s"])
                  for r in rounds if r["on"][t]["ttft_median_s"] and r["off"][t]["tok_s"]]
        row["ttft_speedup"] = statistics.median(x for x, _ in ratios) if ratios else None
        row["tok_s_ratio"] = statistics.median(y for _, y in ratios) if ratios else None
        offs = [r["off"][t]["tok_s"] for r in rounds if r["off"][t]["tok_s"]]
        row["off_tok_s_noise"] = (max(offs) - min(offs)) / statistics.median(offs) if len(offs) > 1 else None
        rows.append(row)
    return rows


def _f(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def render(rows: list[dict], meta: dict) -> str:
    lines = [f"# Prefix cache with the drafter on: {meta['conversations']} conversations x {meta['turns']} turns, "
             f"{meta['prefix_tokens']}-token shared prefix, {meta['max_tokens']} tokens per turn", "",
             f"{meta['target']} + {meta['draft']} on {meta['device']} ({meta['dtype']}), {meta['rounds']} rounds"
             + (f", synthetic tau {meta['tau']} (random weights: acceptance is drawn)" if meta.get("tau") else ""), "",
             "| turn | TTFT on / off (s) | TTFT speedup | tok/s on / off | tok/s ratio | off noise | cached on | "
             "accept len on / off | fallbacks on |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['turn']} | {_f(r['on_ttft_median_s'])} / {_f(r['off_ttft_median_s'])} | "
                     f"{_f(r['ttft_speedup'], '.2f')}x | {_f(r['on_tok_s'], '.1f')} / {_f(r['off_tok_s'], '.1f')} | "
                     f"{_f(r['tok_s_ratio'], '.2f')}x | {_f(r['off_tok_s_noise'], '.1%')} | "
                     f"{_f(r['on_cached_tokens_mean'], '.0f')} | {_f(r['on_accept_len'], '.2f')} / "
                     f"{_f(r['off_accept_len'], '.2f')} | {_f(r['on_fallbacks'], '.0f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prefix-tokens", type=int, default=1000)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tau", type=float, default=None)
    ap.add_argument("--attention", default="auto", help="attention backend: auto | torch | flashinfer (the bundled "
                    "tiny pair's head_dim 32 needs torch on CUDA)")
    ap.add_argument("--memory-share", type=float, default=0.4, help="gpu_memory_utilization of each engine")
    ap.add_argument("--out")
    ap.add_argument("--report")
    a = ap.parse_args(argv)
    if a.target is None:
        from specbench.harness.fixtures import bundled_pair

        t, d = bundled_pair()
        a.target, a.draft = str(t), str(d)
    kw = dict(device=a.device, dtype=a.dtype, synthetic_tau=a.tau, attention_backend=a.attention)
    if a.device.startswith("cuda"):
        kw["gpu_memory_utilization"] = a.memory_share
    on = LLM(a.target, draft=a.draft, **kw)
    if a.device.startswith("cuda"):  # cumulative share: the second engine sizes its pool from what is left
        kw["gpu_memory_utilization"] = min(0.95, 2 * a.memory_share)
    off = LLM(a.target, draft=a.draft, prefix_cache=False, **kw)
    tok = on.tokenizer
    max_pos = on.engine.max_model_len
    need = a.prefix_tokens + a.turns * (a.max_tokens + 64) + 128
    if need > max_pos:
        raise SystemExit(f"--prefix-tokens {a.prefix_tokens} with {a.turns} turns of {a.max_tokens} tokens needs "
                         f"~{need} positions; the engine's usable context is {max_pos}")
    prefix = shared_prefix(tok, a.prefix_tokens)
    questions = [tok.encode(text[-300:]) for _, text in bundled_prompts("gsm8k")[: a.conversations]]
    follow = tok.encode(FOLLOW_UP)
    rounds = []
    for i in range(a.rounds):
        order = ("on", "off") if i % 2 == 0 else ("off", "on")
        r = {arm: run_arm(on if arm == "on" else off, prefix, questions, follow, a.turns, a.max_tokens) for arm in order}
        rounds.append(r)
    rows = summarize(rounds, a.turns)
    meta = {"target": a.target, "draft": a.draft, "device": a.device, "dtype": a.dtype, "tau": a.tau,
            "prefix_tokens": a.prefix_tokens, "conversations": a.conversations, "turns": a.turns,
            "max_tokens": a.max_tokens, "rounds": a.rounds, "attention": a.attention}
    text = render(rows, meta)
    print(text)
    if a.report:
        Path(a.report).parent.mkdir(parents=True, exist_ok=True)
        Path(a.report).write_text(text)
    doc = {"benchmark": "prefix", **meta, "turns_summary": rows, "rounds": rounds}
    emit_document(doc, a.out)
    return doc


if __name__ == "__main__":
    main()
