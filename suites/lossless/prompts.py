"""Prompt sets for the lossless gates, read from the bundled data (harness/data/SOURCES.md formats).

Contract: `load_prompts(dataset, n)` returns the first n (pid, text) pairs of a bundled data set in file
order (deterministic, no sampling): gsm8k test questions in the "Question: ...\\nAnswer:" form the tiny
pair was trained on, the first turn of spec_bench / mt_bench, the first human turn of the ShareGPT
subset, or the HumanEval function prompts. `max_chars` trims very long prompts (a lossless check needs
the continuation, not the whole document). An unknown data set or n < 1 raises `ValueError` naming
the option and the accepted values.
"""

from __future__ import annotations

from specbench.harness.datasets import BUNDLED, bundled_prompts

DATASETS = BUNDLED


def _rows(dataset: str) -> list[tuple[str, str]]:
    return bundled_prompts(dataset)


def load_prompts(dataset: str, n: int, max_chars: int | None = 1000) -> list[tuple[str, str]]:
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--num-prompts {n!r} is invalid: expected an integer >= 1")
    rows = _rows(dataset)[:n]
    if max_chars:
        rows = [(pid, text if len(text) <= max_chars else text[-max_chars:]) for pid, text in rows]
    return rows
