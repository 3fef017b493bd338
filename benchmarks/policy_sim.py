"""The automatic span policy (engine/spec/policy.py) under a simulated closed-loop load: a check of its decisions
that runs in seconds on CPU, with the H200's step costs, against plain decode, a fixed span and the max-batch gate.

Why: a levers run on the GPU costs minutes of lent device time per tau, and what made the policy lose there
(a stalled step pricing span 1, a new wave's prefill-mixed steps timed as one-token rounds, exploration spent at the
wrong batch) is in its bookkeeping, not in the kernels. The simulation drives the real `SpanPolicy` object (choose,
record, step_done, on a simulated clock) through a modelled engine:
- closed loop: `c` requests in flight out of `c x ppl`, each with a prompt of 60-240 tokens (gsm8k-like) and `max_tokens`
  output tokens; a finished request's successor arrives at once and is prefilled by the next step, beside the
  decode-phase requests (a prefill-mixed step); a request drafts from its second decode-phase step on (the first
  is `no_ready` when nobody else can draft);
- step cost (`SimCosts`, milliseconds; defaults fitted to the H200 figures in reports/h200-levers/2026-12-04 and
  reports/h200-engine: plain decode 2.8 ms at c1 to 4.0 at c64; commit-to-commit, span 16 at c1 5.1 ms, span 4 /
  16 at c16 7.0 / 9.2 ms, span 4 / 16 at c64 12.6 / 23 ms): a plain or
  one-token step `decode_ms(b)`; a speculative step `verify_ms(b, s) + draft_ms(b)`; a step that does not run
  one step ahead (anything but a one-token step after a one-token step, with nobody arriving) pays `host_ms`
  more; a prefill chunk `prefill_ms_per_token` per token, and a speculative step beside it runs its verify
  piecewise (`mixed_penalty`); with probability `stall_p` a step stalls `stall_ms` (a collection, a late
  capture);
- acceptance: synthetic at tau (engine/spec/synthetic.py's constant rate for K drafts).
Throughput is committed tokens over simulated time, warm-up (the first `c` completions) included as in a tune
cell. The start-up cost model the policy reads is the dense part (`verify_ms`, `draft_ms`), as the engine's is.

This checks the policy's logic against a model of the machine, not the machine: a result here is a reason to
run `scripts/gpu.sh levers`, not a substitute for it.

    python -m specbench.benchmarks.policy_sim --taus 2.0,3.5,6.5 --levels 1,16,64
"""

from __future__ import annotations

import argparse
import json
import math
import random
import types
from dataclasses import dataclass, field, replace

from ..engine.config import SamplingParams
from ..engine.spec import policy as pm
from ..engine.spec.costs import CostModel
from ..engine.spec.plan import SpecPlan
from ..engine.spec.synthetic import rate_for_tau

K = 15  # drafts of a full span (span 16), the 4B-shaped pair's block


@dataclass
class SimCosts:
    decode0: float = 2.8  # ms, plain / one-token step at b = 1 (run ahead)
    decode_log2: float = 0.2  # ms per doubling of the batch (H200: 2.8 / 3.4 / 3.6 / 4.0 ms at c1 / 8 / 16 / 64)
    verify0: float = 3.4  # ms, a verify step's fixed part
    verify1: float = 0.0135  # ms per verify row (b x s)
    draft0: float = 0.8
    draft1: float = 0.066  # ms per drafting request (its block of K + 1 rows through the drafter and its lm_head)
    host_ms: float = 0.8  # a step that does not run ahead: the host turn the chain hides
    prefill_ms_per_token: float = 0.006
    mixed_penalty: float = 1.25  # a verify beside a prefill chunk runs piecewise
    stall_p: float = 0.0  # e.g. 0.002: stalls are drawn per step, so an arm of more steps meets more of them
    stall_ms: float = 150.0

    def decode_ms(self, b: int) -> float:
        return self.decode0 + self.decode_log2 * math.log2(max(b, 1))

    def verify_ms(self, b: int, s: int) -> float:
        return self.decode_ms(b) if s == 1 else self.verify0 + self.verify1 * b * s

    def draft_ms(self, b: int) -> float:
        return self.draft0 + self.draft1 * b if b else 0.0

    def model(self, spans: list[int]) -> CostModel:
        """The start-up cost model the engine would measure: the dense step, seconds."""
        batches = [1, 2, 4, 8, 16, 32, 64]
        return CostModel(batches, spans, {s: [self.verify_ms(b, s) / 1e3 for b in batches] for s in spans},
                         [self.draft_ms(b) / 1e3 for b in batches])


@dataclass
class _Req:
    rid: str
    prompt_len: int
    max_tokens: int
    in_prefill: bool = True
    out: int = 0
    decode_steps: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)

    @property
    def remaining(self) -> int:
        return self.max_tokens - self.out


class _Proposer:
    def ready(self, r: _Req) -> bool:
        return r.decode_steps >= 1


def _plan(arm: str) -> SpecPlan:
    plan = SpecPlan(enabled=arm != "plain", method="dflash", k=K, headroom=K + 1, drafter=True, sampling=True)
    if arm == "gate1":
        plan = replace(plan, gate=1)
    if arm == "auto":
        plan = replace(plan, policy="auto")
    return plan


def simulate(arm: str, tau: float, c: int, ppl: int = 3, max_tokens: int = 128, costs: SimCosts | None = None,
             seed: int = 0, spread: float = 0.0) -> dict:
    """One closed-loop run of `arm` (plain, spec, gate1, auto): tokens per second and the spans chosen. `spread`:
    each request's max_tokens uniform in [M (1 - S), M (1 + S)] (the same draw for every arm, as `specbench tune
    --max-tokens-spread` does); 0 = every request M tokens (a lockstep batch)."""
    costs = costs or SimCosts()
    rng = random.Random(seed)  # prompts: the same for every arm
    acc_rng = random.Random(seed + 1)  # acceptance draws
    stall_rng = random.Random(seed + 2)  # stalls: one draw per step, the same per step index for every arm
    rate = rate_for_tau(tau, K)
    plan = _plan(arm)
    pol = pm.SpanPolicy(plan, costs.model(list(plan.span_variants)) if arm == "auto" else None)
    clock = [0.0]
    pol.clock = lambda: clock[0]  # the policy's clock: simulated
    pol.chain_ok = lambda: True
    proposer = None if arm == "plain" else _Proposer()
    total = c * ppl
    made = 0
    queue: list[_Req] = []

    def new() -> _Req:
        nonlocal made
        made += 1
        lo, hi = max(1, round(max_tokens * (1 - spread))), max(1, round(max_tokens * (1 + spread)))
        return _Req(f"r{made}", rng.randint(60, 240), rng.randint(lo, hi) if spread else max_tokens)

    running = [new() for _ in range(min(c, total))]
    tokens = 0
    spans: dict[int, int] = {}
    prev_one = False  # the last step was a one-token step with no prefill (the next one may chain)
    while running:
        arrivals = bool(queue)
        running += queue
        queue = []
        ks, _ = pol.choose(running, proposer, 0)
        choice = pol._choice
        decode = [r for r in running if not r.in_prefill]
        prefill = [r for r in running if r.in_prefill]
        one = not ks
        chained = one and prev_one and not prefill and not arrivals and bool(decode)
        b = len(decode)
        if ks:
            s = 1 + max(ks.values())
            ms = costs.verify_ms(b, s) * (costs.mixed_penalty if prefill else 1.0) + costs.draft_ms(len(ks))
        else:
            ms = costs.decode_ms(b) if b else 0.0
        ms += 0.0 if chained else costs.host_ms
        ms += costs.prefill_ms_per_token * sum(r.prompt_len for r in prefill)
        if stall_rng.random() < costs.stall_p:
            ms += costs.stall_ms
        if choice is not None:
            choice.chained = chained
        # outcomes: verify spans accept a synthetic prefix, decode spans commit one token
        sp, res = [], []
        for r in decode:
            k = ks.get(r.rid, 0)
            m = 0
            if k:
                while m < k and acc_rng.random() < rate:
                    m += 1
                sp.append(types.SimpleNamespace(kind="verify", req=r))
                res.append(types.SimpleNamespace(drafts=k, accepted=m))
            else:
                sp.append(types.SimpleNamespace(kind="decode", req=r))
                res.append(types.SimpleNamespace(drafts=0, accepted=None))
            n = min(m + 1, r.remaining)
            r.out += n
            r.decode_steps += 1
            tokens += n
        for r in prefill:
            sp.append(types.SimpleNamespace(kind="prefill", req=r))
            res.append(types.SimpleNamespace(drafts=0, accepted=None))
            r.in_prefill = False
        if b:
            key = 1 + max(ks.values()) if ks else 1
            spans[key] = spans.get(key, 0) + 1
        pol.record(types.SimpleNamespace(spans=sp), res)
        clock[0] += ms / 1e3
        done = [r for r in running if not r.in_prefill and r.remaining <= 0]
        running = [r for r in running if r not in done]
        for _ in done:
            if made < total:
                queue.append(new())
        pol.step_done(busy=bool(running or queue))
        prev_one = one and not prefill and bool(decode)
        if not running and queue:
            running, queue = queue, []
    return {"arm": arm, "tau": tau, "c": c, "tok_s": tokens / clock[0], "tokens": tokens,
            "spans": dict(sorted(spans.items()))}


def run(taus: list[float], levels: list[int], arms: tuple[str, ...] = ("plain", "spec", "gate1", "auto"),
        seeds: int = 3, costs: SimCosts | None = None, **kw) -> list[dict]:
    """Per (tau, c): each arm's tok/s (mean over seeds) and its ratio to plain decode."""
    out = []
    for tau in taus:
        for c in levels:
            row: dict = {"tau": tau, "c": c}
            for arm in arms:
                runs = [simulate(arm, tau, c, costs=costs, seed=s, **kw) for s in range(seeds)]
                row[arm] = sum(r["tok_s"] for r in runs) / seeds
                row[f"{arm}_spans"] = runs[0]["spans"]
            for arm in arms:
                row[f"{arm}_ratio"] = row[arm] / row["plain"]
            out.append(row)
    return out


def render(rows: list[dict], arms: tuple[str, ...] = ("spec", "gate1", "auto")) -> str:
    """Ratios to plain decode per arm, and the automatic policy's tok/s over the better of plain and span 16."""
    lines = ["| tau | c | plain tok/s | " + " | ".join(arms) + " | auto / best of plain, spec |",
             "|---|---|---|" + "---|" * (len(arms) + 1)]
    for r in rows:
        best = max(r["plain"], r.get("spec", 0.0))
        lines.append(f"| {r['tau']} | {r['c']} | {r['plain']:.0f} | " +
                     " | ".join(f"{r[f'{a}_ratio']:.3f}" for a in arms) + f" | {r['auto'] / best:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--taus", default="2.0,3.5,6.5")
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--spread", type=float, default=0.0,
                    help="output length spread S: max_tokens uniform in [M (1 - S), M (1 + S)] (0: all M, lockstep)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--md", default=None, help="write the table here (markdown, with the command)")
    a = ap.parse_args(argv)
    rows = run([float(x) for x in a.taus.split(",")], [int(x) for x in a.levels.split(",")], seeds=a.seeds,
               spread=a.spread)
    print(render(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write("# The automatic span policy in simulation (benchmarks/policy_sim.py)\n\n"
                    f"`python -m specbench.benchmarks.policy_sim --taus {a.taus} --levels {a.levels} --seeds {a.seeds}"
                    f"{f' --spread {a.spread}' if a.spread else ''}`: "
                    "tok/s ratios to plain decode, mean over seeds, simulated H200-fitted step costs (a model of "
                    "the machine, not the machine; the GPU runs are in reports/h200-levers/).\n\n" + render(rows) + "\n")
    return rows


if __name__ == "__main__":
    main()
