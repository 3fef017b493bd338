"""How strongly each sampling fault could act on a candidate's own verify steps (docs/sampled.md tables).

`python -m specbench.benchmarks.sampled_effects [--candidate ngram-soft|ngram|dflash] [--prompt-set echo,repeat]
[--configs ...] [--samples 128] [--positions 4]` generates with the bundled target's candidate (no fault armed)
and, at every sampled verify resolve, reads the target rows p and the draft rows q the accept is given. Per
step with k drafts d_i and clipped ratios r_i = min(1, p_i(d_i) / q_i(d_i)) it accumulates:
  - full: P(every draft accepted) = prod r_i (how often a bonus row is drawn);
  - bonus: full * TV(p_k, normalize((p_k - q_{k-1})^+)), the per-step shift `bonus_residual` makes;
  - reuse: for k >= 2, min(r_0, r_1) - r_0 r_1, the change in P(draft 1 accepted) under `reused_uniform`;
  - overlap: sum_v min(p_k(v), q_{k-1}(v)) and max_v p_k(v), weighted by full (what the bonus fault needs:
    a bonus row that overlaps the last q row).
These are expected values over the engine's own steps, not gate results; the gate's detection at a given
sample size is in the self-test matrix. Tiny pair, CPU.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import torch

import specbench.engine.accept_step as accept_step
from specbench.engine.spec.sampling import LOSSLESS
from specbench.harness.adapters.local import LocalAdapter
from specbench.harness.fixtures import bundled_pair
from specbench.suites.sampled.config import DEFAULT_CONFIGS_TEXT, SOFT_Q_MIX
from specbench.suites.sampled.gate import SampledGateOptions, collect, make_prompts, parse_configs

CANDIDATES = {"ngram-soft": ("ngram", float(SOFT_Q_MIX)), "ngram": ("ngram", 0.0), "dflash": ("dflash", 0.0)}


def _step_effects(st: dict, drafts: list[int], q: torch.Tensor | None, p: torch.Tensor) -> None:
    k = len(drafts)
    if k == 0:
        return
    pd = torch.stack([p[i, d] for i, d in enumerate(drafts)])
    qd = torch.ones(k) if q is None else torch.stack([q[i, d] for i, d in enumerate(drafts)])
    r = (pd / qd.clamp_min(1e-20)).clamp(max=1.0)
    full = float(r.prod())
    qlast = torch.zeros_like(p[k])
    if q is None:
        qlast[drafts[-1]] = 1.0
    else:
        qlast = q[k - 1].to(p.dtype)
    res = (p[k] - qlast).clamp_min(0.0)
    st["steps"] += 1
    st["full"] += full
    st["overlap"] += full * float(torch.minimum(p[k], qlast).sum())
    st["pmax"] += full * float(p[k].max())
    if res.sum() > 0:
        st["bonus"] += full * 0.5 * float((res / res.sum() - p[k]).abs().sum())
    if k >= 2:
        st["k2"] += 1
        st["reuse"] += float(torch.minimum(r[0], r[1]) - r[0] * r[1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--candidate", choices=sorted(CANDIDATES), default="ngram-soft")
    ap.add_argument("--prompt-set", default="echo,repeat")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS_TEXT)
    ap.add_argument("--num-prompts", type=int, default=1)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--positions", type=int, default=4)
    a = ap.parse_args(argv)
    target, draft = map(str, bundled_pair())
    spec, mix = CANDIDATES[a.candidate]
    opts = SampledGateOptions(num_prompts=a.num_prompts, positions=a.positions, samples=a.samples, prompt_chars=200,
                              prompt_set=a.prompt_set)
    base = LocalAdapter.from_dirs(target, spec="off")
    try:  # each set's prompts on their own (echo prompts are built through the baseline)
        by_set = {ps: make_prompts(base, replace(opts, prompt_set=ps)) for ps in opts.prompt_sets}
    finally:
        base.close()
    cand = LocalAdapter.from_dirs(target, draft=draft if spec == "dflash" else None, spec=spec, ngram_mix=mix)
    orig = accept_step.accept_sampled_batch
    current: dict = {}

    def probe(drafts, qs, p, gens, rule=LOSSLESS, kernel=True):
        o = 0
        for d, q in zip(drafts, qs, strict=True):
            _step_effects(current, list(d), q, p[o:o + len(d) + 1])
            o += len(d) + 1
        return orig(drafts, qs, p, gens, rule, kernel)

    accept_step.accept_sampled_batch = probe
    print(f"candidate {a.candidate}; prompts {a.prompt_set} x {a.num_prompts}; {a.samples} samples; P = {a.positions}")
    print("| prompt set | config | verify steps | E[full accept] | bonus_residual shift / step | "
          "reused_uniform Delta | overlap(p_k, q_k-1) | max p_k |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    t0 = time.perf_counter()
    try:
        for pset, sub in by_set.items():
            for c in parse_configs(a.configs):
                current.clear()
                current.update(steps=0, full=0.0, bonus=0.0, reuse=0.0, k2=0, overlap=0.0, pmax=0.0)
                collect(cand, sub, [c], opts, "candidate", 1)
                n, f = max(current["steps"], 1), max(current["full"], 1e-12)
                print(f"| {pset} | {c.name} | {current['steps']} | {current['full'] / n:.3f} | "
                      f"{current['bonus'] / n:.4f} | {current['reuse'] / max(current['k2'], 1):.4f} | "
                      f"{current['overlap'] / f:.3f} | {current['pmax'] / f:.3f} |", flush=True)
    finally:
        accept_step.accept_sampled_batch = orig
        cand.close()
    print(f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
