"""The evalparity suite: lm-eval tasks on a baseline and a candidate arm, compared by the parity rule.

Contract:
- `check_lm_eval()` returns None when lm-eval 0.4.x with its API extras is importable, else a message
  saying how to install it (the CLI prints it and exits 2).
- `run_parity(cfg)` opens one run in the results store (suite "evalparity"), renders the bundled tasks
  into <run>/tasks/, then for each arm in turn (baseline first) opens its endpoint (endpoint.py: a local
  engine becomes a `specbench serve` subprocess, always stopped afterwards), runs the lm-eval worker
  in a subprocess against it (logs in <run>/<arm>-lm_eval.log, server logs in <run>/<arm>-server.log),
  and appends every per-sample outcome to <run>/samples.jsonl as it lands (kind "samples": arm,
  task, doc_id, filter, raw generation, extracted answer, target, scores). Arms run one at a time so
  each has the machine to itself and its wall time means something.
- Both arms get the same tasks, shots, limit, concurrency and tokenizer backend. With backend "auto"
  it is "remote" (lm-eval tokenizes through /tokenize and truncates prompts to the server's context)
  when both endpoints answer /tokenizer_info and /tokenize, else "none" (text prompts); the baseline's
  endpoint decides, and a candidate that cannot follow is refused before it runs.
- Progress: `run_parity(cfg, progress)` (cli/progress.py RunProgress, or None) hears each arm's phases (its
  endpoint starting, then lm-eval with its documents) and the worker's counts (worker.py: requests handed to
  lm-eval's API model and answered, one per document for a generation task), polled twice a second; the
  total is both arms' (the candidate gets the baseline's documents).
- The result (`ParityRun`) is also written as <run>/report.md and <run>/report.json and as the run
  record's summary. Errors inside an arm (server did not start, lm-eval failed) raise `EvalError` with
  the log tail; the run is then marked incomplete by the store.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from specbench.harness.engines import EngineSpec

from .endpoint import Endpoint, die_with_parent, open_endpoint, spec_counters, spec_delta, stop_process
from .parity import compare
from .report import ArmInfo, ParityRun, render_markdown, to_json
from .tasks import render_tasks
from .worker import OFFLINE_ENV, LmEvalSpec

SUITE_VERSION = "1"
LM_EVAL_MAX_GEN_TOKS = 256  # TemplateAPI.max_gen_toks default in lm-eval 0.4.x
BACKENDS = ("auto", "remote", "none")
WORKER = "specbench.suites.evalparity.worker"  # the module run_worker runs as `python -m` (a test swaps in a fake)
INSTALL_HINT = ("lm-eval is not installed: `pip install 'specbench[eval]'` (or `pip install 'lm-eval[api]>=0.4.4,<0.5' "
                "pyyaml`), then run `specbench eval` again.")


class EvalError(RuntimeError):
    """An arm could not be evaluated (its endpoint or its lm-eval run failed)."""


@dataclass
class EvalConfig:
    baseline: EngineSpec
    candidate: EngineSpec
    tasks: tuple[str, ...] = ("gsm8k",)
    limit: int | None = None
    num_fewshot: int | None = 5
    concurrency: int = 4
    tokenizer_backend: str = "auto"
    results: str | None = None
    max_length: int | None = None  # lm-eval's context budget for both arms (remote backend); None: each server's
    startup_timeout_s: float = 600.0
    request_timeout_s: int = 1800


def check_lm_eval() -> str | None:
    missing = [m for m in ("lm_eval", "datasets", "aiohttp", "tenacity", "requests", "yaml")
               if importlib.util.find_spec(m) is None]
    if missing:
        return INSTALL_HINT + f" (missing: {', '.join(missing)})"
    from importlib.metadata import version

    v = version("lm_eval")
    if not v.startswith("0.4."):
        return f"lm-eval {v} is installed; specbench eval needs 0.4.x: `pip install 'lm-eval[api]>=0.4.4,<0.5'`"
    return None


def _tail(path: Path, n: int = 40) -> str:
    if not path.is_file():
        return ""
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-n:])


def read_progress(path: Path) -> tuple[int, int] | None:
    """(done, total) from a worker's progress file (worker.py), None before it exists or while unreadable."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        return int(d["done"]), int(d["total"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_worker(spec: LmEvalSpec, workdir: Path, role: str,
               on_progress: Callable[[int, int], None] | None = None, poll_s: float = 0.5,
               api_key: str | None = None) -> dict:
    """Run the lm-eval worker for one arm; return its JSON. Raises EvalError with the log tail.
    `on_progress(done, total)` hears the worker's counts whenever they change (polled every `poll_s`);
    `api_key`: the endpoint's bearer key, which lm-eval's local-completions sends from $OPENAI_API_KEY."""
    spec_path, out_path, log_path = workdir / f"{role}-spec.json", workdir / f"{role}-lm_eval.json", \
        workdir / f"{role}-lm_eval.log"
    prog_path = workdir / f"{role}-progress.json"
    if on_progress is not None:
        spec = replace(spec, progress_path=str(prog_path))
    spec_path.write_text(json.dumps(asdict(spec), indent=2), encoding="utf-8")
    env = {**os.environ, **OFFLINE_ENV, **({"OPENAI_API_KEY": api_key} if api_key else {})}
    last: tuple[int, int] | None = None

    def report() -> None:
        nonlocal last
        now = read_progress(prog_path) if on_progress is not None else None
        if now is not None and now != last:
            last = now
            on_progress(*now)  # type: ignore[misc]

    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen([sys.executable, "-m", WORKER, str(spec_path),
                                 str(out_path)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, preexec_fn=die_with_parent)
        rc: int | None
        try:
            if on_progress is None:
                rc = proc.wait()
            else:
                while (rc := proc.poll()) is None:  # Ctrl-C lands here as in wait(): the finally stops it
                    time.sleep(poll_s)
                    report()
                report()
        finally:
            stop_process(proc, grace=5.0)
    if rc != 0 or not out_path.is_file():
        raise EvalError(f"lm-eval failed for the {role} arm (exit {rc}); {log_path}:\n{_tail(log_path)}")
    return json.loads(out_path.read_text(encoding="utf-8"))


def _backend(requested: str, ep: Endpoint, fixed: str | None) -> str:
    if fixed is not None:
        if fixed == "remote" and not ep.remote_tokenizer:
            raise EvalError(f"the baseline ran with lm-eval's remote tokenizer but {ep.root} does not answer "
                            "/tokenizer_info and /tokenize; rerun with --tokenizer-backend none")
        return fixed
    if requested == "auto":
        return "remote" if ep.remote_tokenizer else "none"
    if requested == "remote" and not ep.remote_tokenizer:
        raise EvalError(f"--tokenizer-backend remote: {ep.root} does not answer /tokenizer_info and /tokenize")
    return requested


def _sample_records(role: str, name: str, tasks: dict[str, Any]) -> list[dict]:
    return [{"arm": role, "engine_name": name, "task": task, **s}
            for task, t in tasks.items() for s in t["samples"]]


def run_parity(cfg: EvalConfig, progress: Any = None) -> tuple[ParityRun, Path]:
    """Run both arms and compare them; returns the run and its results-store folder. `progress`: module
    docstring."""
    from specbench.harness.results import open_run

    if cfg.tokenizer_backend not in BACKENDS:
        raise ValueError(f"tokenizer_backend={cfg.tokenizer_backend!r} is invalid: expected one of {', '.join(BACKENDS)}")
    arms = (("baseline", cfg.baseline), ("candidate", cfg.candidate))
    engines = {role: {"engine": s.raw or f"{s.kind}:{s.target}", "kind": s.kind} for role, s in arms}
    conf = {k: v for k, v in asdict(cfg).items() if k not in ("baseline", "candidate")}
    with open_run("evalparity", SUITE_VERSION, engines=engines, config=conf, results=cfg.results,
                  sampling={"temperature": 0.0, "source": "task generation_kwargs"},
                  dataset={"tasks": list(cfg.tasks), "limit": cfg.limit, "num_fewshot": cfg.num_fewshot,
                           "data": "bundled harness/data (offline)"}) as run:
        include = render_tasks(list(cfg.tasks), run.path / "tasks")
        results: dict[str, dict] = {}
        infos: list[ArmInfo] = []
        backend: str | None = None
        done_before = [0]  # documents of the arms already run
        for role, spec in arms:
            name = spec.options.get("name", role)
            label = role if name == role else f"{role} ({name})"
            if progress is not None:
                progress.phase(f"{label}: " + ("starting its server" if spec.kind == "local" else
                                               "opening the endpoint"), None)
            on_progress = None if progress is None else _arm_progress(progress, role, label, done_before)
            with open_endpoint(spec, name, run.path / f"{role}-server.log", cfg.startup_timeout_s) as ep:
                backend = _backend(cfg.tokenizer_backend, ep, backend)
                ls = LmEvalSpec(tasks=list(cfg.tasks), include_path=str(include), base_url=ep.completions_url,
                                model=ep.model, num_fewshot=cfg.num_fewshot, limit=cfg.limit,
                                num_concurrent=cfg.concurrency, tokenizer_backend=backend,
                                max_length=(cfg.max_length or ep.max_model_len) if backend == "remote" else None,
                                timeout_s=cfg.request_timeout_s)
                before = spec_counters(ep)
                out = run_worker(ls, run.path, role, on_progress, api_key=ep.api_key)
                done_before[0] = progress.done if progress is not None else 0
                counters = spec_delta(before, spec_counters(ep))
            for rec in _sample_records(role, name, out["tasks"]):
                run.write("samples", rec)
            results[role] = out
            infos.append(ArmInfo(role, name, ep.engine, ep.model, ep.root, backend, ls.max_length, out["wall_s"],
                                 out["lm_eval_version"], out["model_args"],
                                 {"spec": counters, "endpoint_info": ep.info, "n_shot": {t: v.get("n_shot") for t, v in out["tasks"].items()},
                                  "task_versions": {t: v.get("version") for t, v in out["tasks"].items()}}))
            run.update(engines={**run.record.engines, role: {**engines[role], "model": ep.model,
                                                              "endpoint": ep.root, **ep.info}})
        rows = compare(results["baseline"]["tasks"], results["candidate"]["tasks"])
        max_gen = _max_gen_toks(include, list(cfg.tasks))
        pr = ParityRun(list(cfg.tasks), cfg.num_fewshot, cfg.limit, cfg.concurrency, rows, infos,
                       _notes(infos, results, max_gen), run.run_id, str(run.path / "samples.jsonl"),
                       prompt_mismatches(results, infos, max_gen))
        doc = to_json(pr)
        (run.path / "report.json").write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
        (run.path / "report.md").write_text(render_markdown(pr), encoding="utf-8")
        with contextlib.suppress(Exception):
            run.update(summary={"verdict": pr.verdict, "rows": doc["rows"],
                                "wall_s": {a.role: a.wall_s for a in infos}})
        return pr, run.path


def _arm_progress(progress: Any, role: str, label: str, done_before: list[int]) -> Callable[[int, int], None]:
    """One arm's worker counts -> the run's display: the first count names the phase; the total is this arm's
    plus, for the baseline, as many again for the candidate (the same tasks, documents and limit)."""
    named = [False]

    def on(done: int, total: int) -> None:
        whole = done_before[0] + total * (2 if role == "baseline" else 1)
        if total and not named[0]:  # the phase line says what was done before it
            named[0] = True
            progress.plan(whole)
            progress.phase(f"{label}: lm-eval", total)
        progress.update(done_before[0] + done, whole)
    return on


def _max_gen_toks(include: Path, tasks: list[str]) -> dict[str, int]:
    """Each task's generation budget as lm-eval applies it (its generation_kwargs, else lm-eval's 256)."""
    import yaml

    out = {}
    for t in tasks:
        cfg = yaml.safe_load((include / f"{t}.yaml").read_text(encoding="utf-8"))
        out[t] = int((cfg.get("generation_kwargs") or {}).get("max_gen_toks", LM_EVAL_MAX_GEN_TOKS))
    return out


def prompt_mismatches(results: dict[str, dict], infos: list[ArmInfo], max_gen: dict[str, int]) -> dict[str, list[int]]:
    """Per task, the documents whose prompt differs between the arms as the servers received it.

    lm-eval (remote tokenizer) keeps the last (max_length - 1 - max_gen_toks) prompt tokens; two arms
    with different budgets (a drafter's headroom shrinks the context) send different prompts exactly
    where a prompt is longer than the smaller budget. Different prompt hashes also count."""
    limits = {a.role: (a.max_length - 1 if a.max_length else None) for a in infos}
    out: dict[str, list[int]] = {}
    for task, base in results["baseline"]["tasks"].items():
        cand = results["candidate"]["tasks"].get(task, {"samples": []})
        seen: dict[int, dict[str, tuple]] = {}
        for role, t in (("baseline", base), ("candidate", cand)):
            for smp in t["samples"]:
                lim = limits[role]
                n = smp.get("prompt_tokens")
                eff = min(n, lim - max_gen[task]) if (n is not None and lim is not None) else n
                seen.setdefault(smp["doc_id"], {})[role] = (smp.get("prompt_hash"), eff)
        bad = sorted(d for d, v in seen.items() if v.get("baseline") != v.get("candidate"))
        if bad:
            out[task] = bad
    return out


def _notes(infos: list[ArmInfo], results: dict[str, dict], max_gen: dict[str, int]) -> list[str]:
    notes: list[str] = []
    budgets = {a.max_length for a in infos}
    if len({a.tokenizer_backend for a in infos}) > 1:
        notes.append("the arms used different tokenizer backends: "
                     + "; ".join(f"{a.role}: {a.tokenizer_backend}" for a in infos))
    mismatched = prompt_mismatches(results, infos, max_gen)
    if len(budgets) > 1 and not mismatched:
        notes.append("context budgets differ (" + ", ".join(f"{a.role} {a.max_length}" for a in infos)
                     + "), but no prompt was long enough to be cut differently: both arms saw the same prompts")
    for task, ids in mismatched.items():
        fix = (f" Rerun with --max-length {min(b for b in budgets if b)} to give both arms the same budget."
               if len(budgets) > 1 and all(budgets) else "")
        notes.append(f"{task}: {len(ids)} documents reached the arms as different prompts (lm-eval left-truncated "
                     f"them to different context budgets), so their answers are not comparable one to one: "
                     f"doc ids {', '.join(map(str, ids[:30]))}{' ...' if len(ids) > 30 else ''}.{fix}")
    if infos:
        b, c = infos[0].wall_s, infos[-1].wall_s
        if b > 0 and c > 0:
            notes.append(f"lm-eval wall time: baseline {b:.1f} s, candidate {c:.1f} s "
                         f"(candidate/baseline {c / b:.2f}x; includes lm-eval's own overhead, one run each)")
    return notes
