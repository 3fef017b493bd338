"""Is a divergence the prefix cache? The same greedy requests, four ways, against one OpenAI-compatible server.

`python -m specbench.benchmarks.prefix_triage URL MODEL [--prompts N] [--max-tokens T]` prints one JSON line.
The arms, in order: cold with salt A, cold with salt B (a salted request never shares cached blocks with
another salt), then twice with no salt: `fill` fills the cache, `hit` is served from it. A divergence between
`fill` and `hit` that `cold_a` vs `cold_b` does not show is the prefix cache's; its regret (`fill`'s top-20
logprobs at the first divergence, best minus `hit`'s pick) says whether it is a tie flip. scripts/vllm_suite.py
runs it against each bundled and vLLM server (issue 28).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence

from specbench.harness.adapters.base import GenRequest, GenResult
from specbench.suites.lossless.regret import first_divergence

ARMS = ("cold_a", "cold_b", "fill", "hit")
SALTS = {"cold_a": "salt-a", "cold_b": "salt-b", "fill": None, "hit": None}
PAIRS = {"cold_a_vs_cold_b": ("cold_a", "cold_b"), "fill_vs_hit": ("fill", "hit"), "cold_a_vs_fill": ("cold_a", "fill")}


def _first_div(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where both outputs have a token and the tokens differ (a length difference alone is
    no divergence here: the arms run with ignore_eos to the same length)."""
    pos = first_divergence(list(a), list(b))
    return pos if pos is not None and pos < min(len(a), len(b)) else None


def triage(arms: Mapping[str, Sequence[GenResult]]) -> dict:
    """The triage document from the four arms' results (the same prompts, in the same order, in each)."""
    n = len(arms["fill"])
    rows = []
    for i in range(n):
        ids = {k: list(arms[k][i].output_ids or []) for k in ARMS}
        row: dict = {"prompt": i, "ok": all(arms[k][i].ok for k in ARMS)}
        row.update({name: _first_div(ids[a], ids[b]) for name, (a, b) in PAIRS.items()})
        d, lp = row["fill_vs_hit"], arms["fill"][i].logprobs
        if d is not None and lp and d < len(lp):
            top = lp[d].top
            pick = ids["hit"][d]
            best = max(top.values()) if top else None
            row["regret_hit_pick_under_fill"] = None if best is None or pick not in top else round(best - top[pick], 4)
            ranked = sorted(top.values())
            row["fill_top2_margin"] = None if len(ranked) < 2 else round(ranked[-1] - ranked[-2], 4)
        rows.append(row)
    regs = [r["regret_hit_pick_under_fill"] for r in rows if r.get("regret_hit_pick_under_fill") is not None]
    return {"prompts": n, "diverging": {k: sum(r[k] is not None for r in rows) for k in PAIRS},
            "max_regret": max(regs) if regs else None, "regrets": regs, "rows": rows,
            "errors": [arms[k][i].error for k in ARMS for i in range(n) if not arms[k][i].ok][:5]}


def run(url: str, model: str, prompts: Sequence[str], max_tokens: int = 64) -> dict:
    """The four arms against the server at `url`, one request at a time, then `triage`."""
    from specbench.harness.adapters.openai_api import OpenAIAdapter

    out = {}
    for arm in ARMS:
        salt = SALTS[arm]
        ad = OpenAIAdapter(url, model=model, extra_body={"cache_salt": salt} if salt else None)
        try:
            reqs = [GenRequest(prompt=p, max_tokens=max_tokens, temperature=0.0, logprobs=20, ignore_eos=True)
                    for p in prompts]
            out[arm] = ad.generate_sync(reqs, concurrency=1)
        finally:
            ad.close()
    return triage(out)


def main(argv: Sequence[str] | None = None) -> int:
    from specbench.suites.lossless.prompts import load_prompts

    ap = argparse.ArgumentParser(prog="python -m specbench.benchmarks.prefix_triage", description=__doc__.split("\n")[0])
    ap.add_argument("url", help="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    ap.add_argument("model", help="the served model name")
    ap.add_argument("--prompts", type=int, default=16, help="gsm8k prompts (default 16)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    a = ap.parse_args(argv)
    prompts = [text for _pid, text in load_prompts("gsm8k", a.prompts)]
    print(json.dumps(run(a.url, a.model, prompts, a.max_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
