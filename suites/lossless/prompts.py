"""Prompt sets for the lossless gates, read from the bundled data (harness/data/SOURCES.md formats).

Contract: `load_prompts(dataset, n)` returns the first n (pid, text) pairs of a bundled data set in file
order (deterministic, no sampling): gsm8k test questions in the "Question: ...\\nAnswer:" form the tiny
pair was trained on, the first turn of spec_bench / mt_bench, the first human turn of the ShareGPT
subset, or the HumanEval function prompts. `max_chars` trims very long prompts (a lossless check needs
the continuation, not the whole document). An unknown data set or n < 1 raises `ValueError` naming
the option and the accepted values.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

DATASETS = ("gsm8k", "spec_bench", "mt_bench", "sharegpt", "humaneval")


def _data() -> Path:
    return Path(str(resources.files("specbench.harness") / "data"))


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _rows(dataset: str) -> list[tuple[str, str]]:
    d = _data()
    if dataset == "gsm8k":
        return [(f"gsm8k-{i}", f"Question: {r['question']}\nAnswer:")
                for i, r in enumerate(_jsonl(d / "gsm8k" / "test.jsonl"))]
    if dataset in ("spec_bench", "mt_bench"):
        return [(f"{dataset}-{r.get('question_id', i)}", r["turns"][0])
                for i, r in enumerate(_jsonl(d / dataset / "question.jsonl")) if r.get("turns")]
    if dataset == "sharegpt":
        rows = json.loads((d / "sharegpt" / "ShareGPT_V3_filtered_500.json").read_text(encoding="utf-8"))
        out = []
        for i, r in enumerate(rows):
            turns = [c["value"] for c in r.get("conversations", []) if c.get("from") == "human" and c.get("value")]
            if turns:
                out.append((f"sharegpt-{r.get('id', i)}", turns[0]))
        return out
    if dataset == "humaneval":
        return [(r["task_id"].replace("/", "-"), r["prompt"]) for r in _jsonl(d / "humaneval" / "HumanEval.jsonl.gz")]
    raise ValueError(f"--dataset {dataset!r} is invalid: expected one of {', '.join(DATASETS)}")


def load_prompts(dataset: str, n: int, max_chars: int | None = 1000) -> list[tuple[str, str]]:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--num-prompts {n!r} is invalid: expected an integer >= 1")
    rows = _rows(dataset)[:n]
    if max_chars:
        rows = [(pid, text if len(text) <= max_chars else text[-max_chars:]) for pid, text in rows]
    return rows
