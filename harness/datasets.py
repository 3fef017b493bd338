"""The bundled prompt sets, read once for every suite: (prompt id, prompt text) in file order.

gsm8k: the test split in lm-eval's "Question: ...\\nAnswer:" form (`gsm8k_prompt`, the one home of that
format: the bundled tiny pair was trained on it and every suite prompts with it);
spec_bench / mt_bench: each question's first turn; sharegpt: each conversation's first human turn;
humaneval: each task's prompt. Sources and licenses: harness/data/SOURCES.md.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

BUNDLED = ("gsm8k", "spec_bench", "mt_bench", "sharegpt", "humaneval")
# made by the sweep (suites/sweep/workload.py) rather than read from a bundled file; every command that takes
# --dataset accepts the names of BUNDLED + SYNTHETIC it can use, spelled alike (cli/flags.py dataset_name)
SYNTHETIC = ("random", "custom", "shared_prefix")


def gsm8k_prompt(question: str) -> str:
    """lm-eval's zero-shot gsm8k prompt for one question."""
    return f"Question: {question}\nAnswer:"


def data_dir() -> Path:
    """The bundled data folder of the installed package (or of the source tree)."""
    try:
        p = Path(str(resources.files("specbench.harness") / "data"))
        if p.is_dir():
            return p
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parent / "data"


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: bundled data missing (reinstall specbench)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def bundled_prompts(dataset: str) -> list[tuple[str, str]]:
    """Every prompt of a bundled data set as (id, text), in file order."""
    d = data_dir()
    if dataset == "gsm8k":
        return [(f"gsm8k-{i}", gsm8k_prompt(r["question"])) for i, r in enumerate(_jsonl(d / "gsm8k" / "test.jsonl"))]
    if dataset in ("spec_bench", "mt_bench"):
        return [(f"{dataset}-{r.get('question_id', i)}", r["turns"][0])
                for i, r in enumerate(_jsonl(d / dataset / "question.jsonl")) if r.get("turns")]
    if dataset == "sharegpt":
        path = d / "sharegpt" / "ShareGPT_V3_filtered_500.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: bundled data missing (reinstall specbench)")
        out = []
        for i, r in enumerate(json.loads(path.read_text(encoding="utf-8"))):
            turns = [c["value"] for c in r.get("conversations", []) if c.get("from") == "human" and c.get("value")]
            if turns:
                out.append((f"sharegpt-{r.get('id', i)}", turns[0]))
        return out
    if dataset == "humaneval":
        return [(r["task_id"].replace("/", "-"), r["prompt"]) for r in _jsonl(d / "humaneval" / "HumanEval.jsonl.gz")]
    raise ValueError(f"--dataset {dataset!r} is invalid: expected one of {', '.join(BUNDLED)}")
