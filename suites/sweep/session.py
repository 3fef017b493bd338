"""One sweep end to end: engine strings -> adapters -> workload -> interleaved cells -> results store.

Contract:
- `split_arms("local:a,draft=b,openai:http://x")` splits a comma list of engine strings (a piece that
  starts a new engine kind starts a new arm; `;` also separates); `arm_labels` names them (name=
  option, else spec-off / spec-on / <kind>-<n>), unique.
- `run_sweep` builds every adapter, tokenizes the prompts once per engine, drops prompts that do not fit
  some engine's context (so all arms run the same ones), refuses (ValueError) an engine that fails a
  one-token probe request, writes a `sweep` meta record (config, arms
  with their `describe()` (for an openai engine that includes its capability record,
  adapters/dialect.py), baseline, workload with prompt lengths) and then every request and cell
  record as it happens. When the sweep completes, the acceptance / metrics audit (audit.py) over its
  records is written as an `audit` record and into the run's summary (`SweepOutcome.audit`). On an interrupt (Ctrl-C) the store is closed incomplete with everything
  measured so far, and KeyboardInterrupt propagates.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specbench.harness.adapters.base import EngineAdapter
from specbench.harness.spec_method import spec_method

from .audit import audit_records
from .runner import Arm, SweepConfig, SweepRunner, with_noise_copy
from .workload import Workload

KINDS = ("local", "openai", "hf")
SUITE_VERSION = "1"


def split_arms(text: str) -> list[str]:
    out: list[str] = []
    for chunk in text.split(";"):
        for piece in chunk.split(","):
            p = piece.strip()
            if not p:
                continue
            if re.match(rf"^({'|'.join(KINDS)})(:|$)", p) or not out:
                out.append(p)
            else:
                out[-1] += "," + p
    return out


def arm_labels(engines: list[Any], given: list[str] | None = None) -> list[str]:
    """Labels for the arms: given ones, else each engine's name=, else a readable default."""
    if given:
        if len(given) != len(engines):
            raise ValueError(f"--labels has {len(given)} labels for {len(engines)} arms")
        labels = list(given)
    else:
        labels = []
        for i, e in enumerate(engines):
            o = e.options
            if o.get("name"):
                labels.append(o["name"])
            elif e.kind == "local":
                spec = spec_method(o.get("spec"), o.get("draft"))
                labels.append("spec-off" if spec == "off" else f"spec-{spec}")
            else:
                labels.append(f"{e.kind}-{i + 1}")
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        seen[lab] = seen.get(lab, 0) + 1
        out.append(lab if seen[lab] == 1 else f"{lab}-{seen[lab]}")
    return out


def default_arms() -> list[Any]:
    from specbench.harness.engines import EngineSpec, default_engines

    base, cand = default_engines()
    named = []
    for e, label in ((base, "spec-off"), (cand, "spec-on")):
        named.append(EngineSpec(e.kind, e.target, {**e.options, "name": label}, e.raw))
    return named


@dataclass
class SweepOutcome:
    run_dir: Path | None  # None when interrupted before the store was opened
    records: list[dict] = field(default_factory=list)
    complete: bool = False
    run_meta: dict = field(default_factory=dict)
    audit: dict | None = None  # audit.audit_records over the records (with keep_records)


def _context_limit(ad: EngineAdapter, max_tokens: int) -> int | None:
    try:
        cfg = ad.describe().get("config") or {}
    except Exception:
        return None
    mml = cfg.get("max_model_len") if isinstance(cfg, dict) else None
    if not mml:
        return None
    # describe()'s max_model_len is the usable context: the engine already took its speculation headroom off
    # (engine/spec/plan.py is the one home of that rule), and admits prompt + max_tokens <= max_model_len.
    return int(mml) - max_tokens - 1


def run_sweep(cfg: SweepConfig, engines: list[str] | None = None, labels: list[str] | None = None,
              out_dir: str | Path | None = None, baseline: str | None = None, progress: bool = True,
              keep_records: bool = True) -> SweepOutcome:
    """Run a whole sweep. Ctrl-C returns the outcome so far (complete=False) instead of raising."""
    from specbench.harness.engines import build_adapter, parse_engine

    specs = [parse_engine(e) for e in engines] if engines else default_arms()
    names = arm_labels(specs, labels)
    if baseline is not None and baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not one of the arms {names}")
    arms = [Arm(label=n, engine=s.raw) for n, s in zip(names, specs, strict=True)]
    if cfg.noise_floor:
        arms = with_noise_copy(arms, baseline)
    pool = max(cfg.prompts_at(lv) + cfg.warmup_at(lv) for lv in cfg.levels)
    workload = Workload.build(cfg.dataset, pool, cfg.seed, cfg.random_words)
    outcome = SweepOutcome(run_dir=None)
    adapters: dict[str, EngineAdapter] = {}
    try:
        for a, s in zip(arms, specs, strict=False):
            adapters[a.label] = build_adapter(s, name=a.label)
        asyncio.run(_main(cfg, arms, adapters, workload, out_dir, baseline or arms[0].label, progress,
                          keep_records, outcome))
    except KeyboardInterrupt:
        outcome.complete = False
    finally:
        for ad in adapters.values():
            try:
                ad.close()
            except Exception:
                pass
    return outcome


class _StoreSink:
    """Runner records -> the results store (requests.jsonl, cells.jsonl), mirrored in memory."""

    def __init__(self, run: Any, keep: bool, outcome: SweepOutcome) -> None:
        self.run, self.keep, self.outcome = run, keep, outcome

    def request(self, res: Any, arm: str, idx: int, round: int) -> None:
        rec = self.run.add_result(res, arm=arm, idx=idx, round=round, item_id=str(res.meta.get("prompt_idx")),
                                  keep_text=False)
        if self.keep:
            self.outcome.records.append({"kind": "request", **asdict(rec)})

    def cell(self, record: dict) -> None:
        self.run.write("cells", record)
        if self.keep:
            self.outcome.records.append({"kind": "cell", **record})


async def _main(cfg: SweepConfig, arms: list[Arm], adapters: dict[str, EngineAdapter], workload: Workload,
                out_dir: str | Path | None, baseline: str, progress: bool, keep: bool, outcome: SweepOutcome) -> None:
    from specbench.harness.results import open_run

    for label, ad in adapters.items():
        if callable(getattr(ad, "probe", None)):  # an endpoint's dialect, before its first request
            await asyncio.to_thread(ad.probe)
        await workload.tokenize(label, ad)
    for a in arms:
        if a.copy_of:
            workload.share(a.copy_of, a.label)
    dropped = workload.keep({label: _context_limit(ad, cfg.max_tokens) for label, ad in adapters.items()})
    for label, ad in adapters.items():  # fail fast on an engine that cannot serve at all
        probe = workload.requests(label, [0], max_tokens=1, ignore_eos=True)
        res = (await ad.generate(probe))[0]
        if not res.ok:
            raise ValueError(f"arm {label!r}: a one-token probe request failed before the sweep: {res.error}")
    described = {label: _describe(ad) for label, ad in adapters.items()}
    wl = {**workload.describe(), "dropped_too_long": dropped}
    meta = {"suite": "sweep", "suite_version": SUITE_VERSION, "config": cfg.to_dict(), "baseline": baseline,
            "arms": [{"label": a.label, "engine": a.engine, "copy_of": a.copy_of,
                      "description": described[a.copy_of or a.label]} for a in arms],
            "workload": wl}
    sampling = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens, "ignore_eos": cfg.ignore_eos}
    with open_run("sweep", SUITE_VERSION, engines=described, sampling=sampling, dataset=wl, seeds=cfg.seed,
                  config={**cfg.to_dict(), "baseline": baseline, "arms": meta["arms"]}, results=out_dir) as run:
        outcome.run_dir = run.path
        run.write("sweep", meta)
        if keep:
            outcome.records.append({"kind": "sweep", **meta})
        runner = SweepRunner(cfg, arms, adapters, workload, _StoreSink(run, keep, outcome), progress=progress)
        try:
            await runner.run()
            outcome.complete = True
            if keep:
                outcome.audit = audit_records(outcome.records)
                run.write("audit", outcome.audit)
                run.update(summary={"audit": {"verdict": outcome.audit["verdict"], "missing": outcome.audit["missing"],
                                              "arms": {a["arm"]: a["verdict"] for a in outcome.audit["arms"]}}})
        except asyncio.CancelledError:  # Ctrl-C under asyncio.run: record it as an interrupt
            raise KeyboardInterrupt from None
        finally:
            outcome.run_meta = {"run_id": run.run_id, "status": "complete" if outcome.complete else "incomplete",
                                "started": run.record.started, "provenance": run.record.provenance}
    outcome.run_meta["status"] = run.record.status


def _describe(ad: EngineAdapter) -> dict:
    try:
        return ad.describe()
    except Exception as e:  # provenance must not kill a sweep
        return {"name": ad.name, "kind": ad.kind, "error": f"{type(e).__name__}: {e}"}
