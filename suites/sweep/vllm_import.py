"""`specbench import vllm-bench FILE...`: `vllm bench serve --save-result` files -> one sweep run in the
results store, so `specbench report` renders it (and beside a specbench run: `specbench report RUN1 RUN2`).

Contract: each file is one cell (vllm_format.from_vllm): its arm is `--label` or the file's label
(else its backend), its level the file's max_concurrency (closed loop, request_rate inf) or its
request_rate (open loop); several files of one (arm, level) are rounds 0, 1, ... in the order given.
Files of closed- and open-loop levels cannot be mixed in one run (ValueError naming both files). The
run's records: a `sweep` meta record (source "vllm-bench", the files, arms with the files' model and
backend), one `cell` per file carrying vLLM's own aggregate figures as `stats` (the report shows those,
not a recomputation) and the spec-decode fields as its counter delta (source "vllm-bench"), and a request
record per entry of the per-request lists where the file has them (vLLM's --save-detailed). The
imported figures keep vLLM's conventions: its ITL is the per-chunk gap (the report's raw chunk gaps);
the per-token ITL is unknown and shown as such. Nothing is invented: a field the file lacks stays empty.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .vllm_format import VllmFormatError, from_vllm

SUITE_VERSION = "1"


def load_cells(files: Sequence[str | Path], label: str | None = None) -> list[dict]:
    cells = []
    for f in files:
        p = Path(f)
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise VllmFormatError(f"{p}: no such file") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise VllmFormatError(f"{p}: not JSON ({e}): expected a `vllm bench serve --save-result` file") from None
        c = from_vllm(obj, str(p))
        c["file"] = str(p)
        if label:
            c["label"] = label
        cells.append(c)
    kinds = {c["level_kind"] for c in cells}
    if len(kinds) > 1:
        a = next(c for c in cells if c["level_kind"] == "concurrency")
        b = next(c for c in cells if c["level_kind"] == "rate")
        raise VllmFormatError(f"{a['file']} is closed loop (max_concurrency {a['level']:g}) and {b['file']} open loop "
                              "(a request rate): import them as two runs")
    return cells


def import_vllm_bench(files: Sequence[str | Path], out_dir: str | Path | None = None,
                      label: str | None = None) -> Path:
    """Write the files as one sweep run; returns its directory."""
    from specbench.harness.results import open_run

    cells = load_cells(files, label)
    if not cells:
        raise VllmFormatError("no file given: expected one or more `vllm bench serve --save-result` JSON files")
    rounds: dict[tuple[str, float], int] = {}
    for c in cells:
        key = (c["label"], c["level"])
        c["round"] = rounds.get(key, 0)
        rounds[key] = c["round"] + 1
    arms: dict[str, dict] = {}
    for c in cells:
        h = c["header"]
        arms.setdefault(c["label"], {
            "label": c["label"], "engine": f"vllm-bench:{h.get('backend') or 'openai'}", "copy_of": None,
            "description": {"name": c["label"], "kind": "vllm-bench", "model": c["model_id"], "version": None,
                            "config": {k: v for k, v in h.items() if k not in ("label", "date")}}})
    kind = cells[0]["level_kind"]
    levels = sorted({c["level"] for c in cells})
    first = cells[0]["header"]
    cfg: dict[str, Any] = {
        "levels": levels, "mode": "closed" if kind == "concurrency" else "open", "rounds": max(rounds.values()),
        "warmup": None, "dataset": None, "max_tokens": None, "ignore_eos": None, "temperature": None, "seed": None,
        "arrival": "gamma" if (first.get("burstiness") or 1.0) != 1.0 else "poisson",
        "burstiness": first.get("burstiness"), "max_concurrency": None if kind == "concurrency" else
        first.get("max_concurrency")}
    meta = {"suite": "sweep", "suite_version": SUITE_VERSION, "source": "vllm-bench", "files": [c["file"] for c in cells],
            "config": cfg, "baseline": next(iter(arms)), "arms": list(arms.values()),
            "workload": {"dataset": "as run by vllm bench serve", "kept": first.get("num_prompts")}}
    engines = {a["label"]: a["description"] for a in arms.values()}
    with open_run("sweep", SUITE_VERSION, engines=engines, config=cfg, results=out_dir,
                  dataset={"source": "vllm-bench", "files": meta["files"]}) as run:
        run.write("sweep", meta)
        for c in cells:
            cell = {"arm": c["label"], "level": c["level"], "level_kind": kind, "round": c["round"], "warmup": False,
                    "copy_of": None}
            for i, r in enumerate(c["requests"]):
                run.write("requests", {"run_id": run.run_id, "arm": c["label"], "idx": i, "round": c["round"],
                                       "item_id": str(i), **r, "meta": dict(cell)})
            st = c["stats"]
            run.write("cells", {**cell, "wall_start": None, "duration": st["duration"], "requests": st["requests"],
                                "completed": st["completed"], "counters": c["counters"], "stats": st,
                                "concurrency": int(c["level"]) if kind == "concurrency" and not math.isinf(c["level"])
                                else None, "offsets": kind == "rate", "server_metrics": None,
                                "source": {"vllm_bench": c["file"]}})
        path = run.path
    return path
