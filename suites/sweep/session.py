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
- Every measured cell also becomes a vLLM bench result file, <run>/vllm-bench/<arm>-<level>-r<round>.json
  (vllm_format.py), copied to `result_dir` under vLLM's file naming when given.
- Accounting: the run's summary `requests` (and `SweepOutcome.accounting`) counts the measured requests,
  the failed ones, the retried ones and the extra attempts; a complete sweep with failed requests gets
  the run status "complete_with_failures". `no_tokens` names every measured cell whose answered requests
  (at least one) gave no output token at all: its throughput (0 tok/s) measures nothing (the CLI: CANNOT TEST).
- Secrets: `api_key` (for openai arms without their own), $OPENAI_API_KEY and every api_key= option are
  the run's secrets: masked in the arms' engine strings, in every record and file of the store and in the
  ValueError messages this raises (harness/redact.py).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specbench.harness.adapters.base import EngineAdapter
from specbench.harness.engines import spec_method
from specbench.harness.redact import redact_text

from ..metrics_audit import per_step_stream, settle
from .audit import audit_records
from .runner import Arm, SweepConfig, SweepRunner, _k, with_noise_copy
from .vllm_format import to_vllm
from .workload import Workload, output_len_range

KINDS = ("local", "openai", "hf")
SUITE_VERSION = "1"
FAILED_REQUESTS = "complete_with_failures"  # run.json status of a finished sweep with failed requests


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
    accounting: dict = field(default_factory=dict)  # requests, failed, retried, extra attempts (measured cells)


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
              out_dir: str | Path | None = None, baseline: str | None = None, progress: Any = None,
              keep_records: bool = True, api_key: str | None = None,
              result_dir: str | Path | None = None) -> SweepOutcome:
    """Run a whole sweep. Ctrl-C returns the outcome so far (complete=False) instead of raising.
    `api_key`: for openai arms without their own api_key= (else $OPENAI_API_KEY); every key is masked
    in every record, file and error text. `result_dir`: also copy each cell's vLLM bench file there.
    `progress`: None, or a display the runner plans, names each cell to and advances per finished request
    (runner.py; cli/progress.py RunProgress)."""
    import os

    from specbench.harness.engines import build_adapter, parse_engine

    specs = [parse_engine(e) for e in engines] if engines else default_arms()
    secrets = [api_key, os.environ.get("OPENAI_API_KEY")] + [s.options.get("api_key") for s in specs]
    secrets_t = tuple(str(x) for x in secrets if x)
    names = arm_labels(specs, labels)
    if baseline is not None and baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not one of the arms {names}")
    arms = [Arm(label=n, engine=redact_text(s.raw, secrets_t)) for n, s in zip(names, specs, strict=True)]
    if cfg.noise_floor:
        arms = with_noise_copy(arms, baseline)
    pool = max(cfg.prompts_at(lv) + cfg.warmup_at(lv) for lv in cfg.levels)
    workload = Workload.build(cfg.dataset, pool, cfg.seed, cfg.random_input_len, cfg.dataset_path,
                              chat=cfg.endpoint_type == "chat")
    outcome = SweepOutcome(run_dir=None)
    adapters: dict[str, EngineAdapter] = {}
    try:
        for a, s in zip(arms, specs, strict=False):
            adapters[a.label] = ad = build_adapter(s, name=a.label)
            use = getattr(ad, "use_api_key", None)
            if api_key and callable(use) and not s.options.get("api_key"):
                use(api_key, "--api-key")
            if cfg.client_procs != 1 and ad.kind == "openai":  # the client's load over several processes
                from specbench.harness.adapters.sharded import ShardedAdapter

                key = api_key if not s.options.get("api_key") else None
                adapters[a.label] = ShardedAdapter(ad, s.raw, cfg.client_procs, key)
        asyncio.run(_main(cfg, arms, adapters, workload, out_dir, baseline or arms[0].label, progress,
                          keep_records, outcome, secrets_t, result_dir))
    except KeyboardInterrupt:
        outcome.complete = False
    except ValueError as e:  # refused before or during the run: the message must not carry a key either
        raise ValueError(redact_text(str(e), secrets_t)) from None
    finally:
        for ad in adapters.values():
            try:
                ad.close()
            except Exception:
                pass
    return outcome


class _StoreSink:
    """Runner records -> the results store (requests.jsonl, cells.jsonl), mirrored in memory; each measured
    cell also as a vLLM bench result file (vllm_format.py) in <run>/vllm-bench/ and, with `result_dir`,
    a copy there under vLLM's own file naming."""

    def __init__(self, run: Any, keep: bool, outcome: SweepOutcome, cfg: SweepConfig | None = None,
                 models: dict[str, Any] | None = None, kinds: dict[str, str] | None = None,
                 result_dir: str | Path | None = None) -> None:
        self.run, self.keep, self.outcome = run, keep, outcome
        self.cfg, self.models, self.kinds = cfg, models or {}, kinds or {}
        self.result_dir = Path(result_dir) if result_dir else None
        self.pending: dict[tuple[str, float, int], list[dict]] = {}
        self.vllm_files: list[Path] = []
        self.n = self.retried = self.extra = 0
        self.failed: list[str] = []
        self.cell_tokens: dict[tuple[str, float, int], list[int]] = {}  # measured cell -> [answered, output tokens]
        self.no_tokens: list[str] = []  # measured cells that were answered with no token at all
        self.busy_max = 0.0
        self.saturated: list[str] = []  # measured cells where the client's event loop was the bottleneck

    def accounting(self) -> dict:
        """Requests of the measured cells (warm-up excluded): how many failed, were retried, extra attempts;
        the first errors."""
        return {"requests": self.n, "failed": len(self.failed), "retried": self.retried,
                "extra_attempts": self.extra, "first_errors": self.failed[:5], "no_tokens": list(self.no_tokens),
                "client_busy_max": round(self.busy_max, 4), "client_saturated": list(self.saturated)}

    def request(self, res: Any, arm: str, idx: int, round: int) -> None:
        rec = self.run.add_result(res, arm=arm, idx=idx, round=round, item_id=str(res.meta.get("prompt_idx")),
                                  keep_text=False)
        d = asdict(rec)
        if not res.meta.get("warmup"):
            self.n += 1
            self.retried += res.attempts > 1
            self.extra += max(0, res.attempts - 1)
            key = (arm, float(res.meta.get("level", 0)), round)
            if not res.ok:
                self.failed.append(f"{arm}: {redact_text(str(res.error), self.run.secrets)[:300]}")
            else:
                n = self.cell_tokens.setdefault(key, [0, 0])
                n[0] += 1
                n[1] += int(res.completion_tokens or 0)
            self.pending.setdefault(key, []).append(d)
        if self.keep:
            self.outcome.records.append({"kind": "request", **d})

    def cell(self, record: dict) -> None:
        self.run.write("cells", record)
        if self.keep:
            self.outcome.records.append({"kind": "cell", **record})
        key = (record["arm"], float(record["level"]), record["round"])
        reqs = self.pending.pop(key, [])
        load = record.get("client") or {}
        answered, tokens = self.cell_tokens.pop(key, [0, 0])
        if not record.get("warmup") and answered and not tokens:
            closed = record.get("level_kind") == "concurrency"
            self.no_tokens.append(f"{record['arm']} {_level_tag(float(record['level']), closed)} r{record['round']}")
        if not record.get("warmup"):
            self.busy_max = max(self.busy_max, float(load.get("busy") or 0.0))
            if load.get("saturated"):
                tag = _level_tag(float(record["level"]), record.get("level_kind") == "concurrency")
                self.saturated.append(f"{record['arm']} {tag} r{record['round']}")
        if not record.get("warmup") and self.cfg is not None:
            self._write_vllm(record, reqs)

    def _write_vllm(self, cell: dict, reqs: list[dict]) -> None:
        cfg, arm = self.cfg, cell["arm"]
        assert cfg is not None
        src = cell.get("copy_of") or arm
        level = float(cell["level"])
        closed = cell.get("level_kind") == "concurrency"
        kind = self.kinds.get(src, "openai")
        backend = ("openai-chat" if cfg.endpoint_type == "chat" else "openai") if kind == "openai" else \
            f"specbench-{kind}"
        name = _level_tag(level, closed)
        extras = {"run_id": self.run.run_id, "arm": arm, "copy_of": cell.get("copy_of"), "level": level,
                  "level_kind": cell.get("level_kind"), "round": cell["round"], "client": cell.get("client")}
        res = to_vllm(reqs, cell, label=arm, model_id=self.models.get(src), backend=backend,
                      num_prompts=len(reqs), request_rate=None if closed else level, burstiness=cfg.burstiness,
                      max_concurrency=int(level) if closed else cfg.max_concurrency, extras=extras)
        text = json.dumps(res, default=str)
        folder = self.run.path / "vllm-bench"
        folder.mkdir(exist_ok=True)
        f = folder / f"{_safe(arm)}-{name}-r{cell['round']}.json"
        self.run.write_text(f, text)
        self.vllm_files.append(f)
        if self.result_dir is not None:  # vLLM's naming: {label}-{rate}qps[-concurrency{C}]-{model}-{date}.json
            self.result_dir.mkdir(parents=True, exist_ok=True)
            rate = "inf" if closed else f"{level:g}"
            conc = f"-concurrency{int(level) if closed else cfg.max_concurrency}" if closed or cfg.max_concurrency \
                else ""
            model = _safe(str(self.models.get(src) or "model").split("/")[-1])
            self.run.write_text(self.result_dir / f"{_safe(arm)}-{rate}qps{conc}-{model}-{res['date']}-r{cell['round']}"
                                                   ".json", text)


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _level_tag(level: float, closed: bool) -> str:
    return f"c{int(level)}" if closed else f"r{level:g}"


async def _main(cfg: SweepConfig, arms: list[Arm], adapters: dict[str, EngineAdapter], workload: Workload,
                out_dir: str | Path | None, baseline: str, progress: Any, keep: bool, outcome: SweepOutcome,
                secrets: tuple[str, ...] = (), result_dir: str | Path | None = None) -> None:
    from specbench.harness.results import open_run

    for label, ad in adapters.items():
        probe_dialect = getattr(ad, "probe", None)
        if callable(probe_dialect):  # an endpoint's dialect, before its first request
            await asyncio.to_thread(probe_dialect)
        await workload.tokenize(label, ad)
    for a in arms:
        if a.copy_of:
            workload.share(a.copy_of, a.label)
    dropped = workload.keep({label: _context_limit(ad, cfg.max_tokens_hi) for label, ad in adapters.items()})
    for label, ad in adapters.items():  # fail fast on an engine that cannot serve at all
        probe = workload.requests(label, [0], max_tokens=1, ignore_eos=True)
        before_m = await settle(ad)
        res = (await ad.generate(probe))[0]
        if not res.ok:
            raise ValueError(f"arm {label!r}: a one-token probe request failed before the sweep: {res.error}")
        if before_m is not None:  # its counts published before the first cell (a server may count it late)
            await settle(ad, before_m, [res], k=_k(ad), per_step=per_step_stream(_describe(ad)))
    described = {label: _describe(ad) for label, ad in adapters.items()}
    wl = {**workload.describe(), "dropped_too_long": dropped}
    meta = {"suite": "sweep", "suite_version": SUITE_VERSION, "config": cfg.to_dict(), "baseline": baseline,
            "arms": [{"label": a.label, "engine": a.engine, "copy_of": a.copy_of,
                      "description": described[a.copy_of or a.label]} for a in arms],
            "workload": wl}
    sampling: dict = {"temperature": cfg.temperature, "max_tokens": cfg.max_tokens, "ignore_eos": cfg.ignore_eos}
    if cfg.max_tokens_spread:
        sampling["max_tokens_range"] = list(output_len_range(cfg.max_tokens, cfg.max_tokens_spread))
    models = {label: (described[label] or {}).get("model") for label in adapters}
    kinds = {label: ad.kind for label, ad in adapters.items()}
    with open_run("sweep", SUITE_VERSION, engines=described, sampling=sampling, dataset=wl, seeds=cfg.seed,
                  config={**cfg.to_dict(), "baseline": baseline, "arms": meta["arms"]}, results=out_dir,
                  secrets=secrets) as run:
        outcome.run_dir = run.path
        run.write("sweep", meta)
        if keep:
            outcome.records.append({"kind": "sweep", **meta})
        sink = _StoreSink(run, keep, outcome, cfg, models, kinds, result_dir)
        runner = SweepRunner(cfg, arms, adapters, workload, sink, progress=progress)
        try:
            await runner.run()
            outcome.complete = True
            outcome.accounting = sink.accounting()
            summary: dict[str, Any] = {"requests": outcome.accounting}
            if keep:
                outcome.audit = audit_records(outcome.records)
                run.write("audit", outcome.audit)
                summary["audit"] = {"verdict": outcome.audit["verdict"], "missing": outcome.audit["missing"],
                                    "arms": {a["arm"]: a["verdict"] for a in outcome.audit["arms"]}}
            run.update(summary=summary)
        except asyncio.CancelledError:  # Ctrl-C under asyncio.run: record it as an interrupt
            raise KeyboardInterrupt from None
        finally:
            outcome.run_meta = {"run_id": run.run_id, "status": "complete" if outcome.complete else "incomplete",
                                "started": run.record.started, "provenance": run.record.provenance}
    if outcome.complete and outcome.accounting.get("failed"):
        run.update(status=FAILED_REQUESTS)  # every cell ran, but not every request was answered
    outcome.run_meta["status"] = run.record.status


def _describe(ad: EngineAdapter) -> dict:
    try:
        return ad.describe()
    except Exception as e:  # provenance must not kill a sweep
        return {"name": ad.name, "kind": ad.kind, "error": f"{type(e).__name__}: {e}"}
