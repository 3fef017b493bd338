"""Sweep workloads: prompts from the bundled data sets (or random text), tokenized once per engine.

Contract:
- `load_texts(dataset, n, seed)` returns n prompt texts in a seeded order: spec_bench / mt_bench
  (first turn), sharegpt (first human turn), gsm8k (test split, lm-eval's "Question: ...\\nAnswer:"
  form, which is also what the bundled tiny pair was trained on), or random (words drawn from the
  bundled prompts: the trap to know is that random prompts understate acceptance). A data set smaller
  than n is cycled; `Workload.repeats` says so.
- `Workload.tokenize(arm, adapter)` tokenizes every prompt once with that engine's own tokenizer (its
  `tokenize`, e.g. /tokenize) and records the lengths. Requests then carry token ids, so no tokenizer
  round trip can change a prompt's length between arms; an engine that cannot tokenize (or answers an
  empty token list for a non-empty text) gets the text and its lengths come from usage. Copies of an arm (the noise-floor arm) share its ids.
- `Workload.keep(max_len)` drops prompts that would not fit an engine's context for EVERY arm at once,
  so all arms always run the same prompts.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import numpy as np

from specbench.harness.adapters.base import EngineAdapter, GenRequest
from specbench.harness.datasets import bundled_prompts

DATASETS = ("gsm8k", "spec_bench", "mt_bench", "sharegpt", "random")


class WorkloadError(ValueError):
    """Bad workload input (unknown data set, impossible sizes); the message names the option."""


def dataset_texts(dataset: str) -> list[str]:
    """Every prompt of a bundled data set, in file order."""
    if dataset not in DATASETS or dataset == "random":
        raise WorkloadError(f"--dataset {dataset!r} is invalid: expected one of {', '.join(DATASETS)}")
    try:
        return [text for _, text in bundled_prompts(dataset)]
    except FileNotFoundError as e:
        raise WorkloadError(str(e)) from None


def random_texts(n: int, words: int, seed: int) -> list[str]:
    """n prompts of `words` words drawn uniformly from the vocabulary of the bundled prompts."""
    vocab = sorted({w for t in dataset_texts("spec_bench") for w in re.findall(r"[A-Za-z]+", t)})
    rng = np.random.default_rng(seed)
    return [" ".join(vocab[i] for i in rng.integers(0, len(vocab), size=words)) for _ in range(n)]


def load_texts(dataset: str, n: int, seed: int = 0, random_words: int = 64) -> tuple[list[str], int]:
    """(n texts in a seeded order, how many times the data set had to be repeated to reach n)."""
    if n < 1:
        raise WorkloadError(f"number of prompts {n} is invalid: expected >= 1")
    if dataset == "random":
        return random_texts(n, random_words, seed), 1
    texts = dataset_texts(dataset)
    order = np.random.default_rng(seed).permutation(len(texts))
    reps = -(-n // len(texts))
    return [texts[order[i % len(texts)]] for i in range(n)], reps


@dataclass
class Workload:
    dataset: str
    texts: list[str]
    seed: int = 0
    repeats: int = 1
    ids: dict[str, list[list[int] | None]] = field(default_factory=dict)  # arm -> ids per prompt
    kept: list[int] = field(default_factory=list)  # indices into texts still in play

    @classmethod
    def build(cls, dataset: str, n: int, seed: int = 0, random_words: int = 64) -> Workload:
        texts, reps = load_texts(dataset, n, seed, random_words)
        return cls(dataset=dataset, texts=texts, seed=seed, repeats=reps, kept=list(range(len(texts))))

    async def tokenize(self, arm: str, adapter: EngineAdapter, parallel: int = 16) -> None:
        sem = asyncio.Semaphore(parallel)

        async def one(text: str) -> list[int] | None:
            async with sem:
                try:
                    ids = await adapter.tokenize(text)
                except Exception:  # an endpoint without /tokenize: fall back to text + usage
                    return None
                if ids is None or (text and not ids):  # an empty list for a non-empty text is never a prompt
                    return None
                return list(ids)

        self.ids[arm] = list(await asyncio.gather(*(one(t) for t in self.texts)))

    def share(self, arm: str, copy: str) -> None:
        self.ids[copy] = self.ids[arm]

    def lengths(self, arm: str) -> list[int | None]:
        ids = self.ids.get(arm) or [None] * len(self.texts)
        return [None if x is None else len(x) for x in ids]

    def keep(self, max_len: dict[str, int | None]) -> int:
        """Keep prompts whose length fits max_len[arm] for every arm; returns how many were dropped."""
        before = len(self.kept)
        lens = {a: self.lengths(a) for a in max_len}
        self.kept = [i for i in self.kept
                     if all(m is None or lens[a][i] is None or lens[a][i] <= m for a, m in max_len.items())]
        return before - len(self.kept)

    def requests(self, arm: str, positions: list[int], max_tokens: int, ignore_eos: bool,
                 temperature: float = 0.0, meta: dict | None = None) -> list[GenRequest]:
        """Requests for the kept prompts at `positions` (indices into `kept`, wrapped around)."""
        if not self.kept:
            raise WorkloadError("no prompt fits the engines' context: lower --max-tokens or pick another --dataset")
        ids = self.ids.get(arm)
        out = []
        for p in positions:
            i = self.kept[p % len(self.kept)]
            prompt = ids[i] if ids and ids[i] is not None else self.texts[i]
            out.append(GenRequest(prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                  ignore_eos=ignore_eos, meta={**(meta or {}), "prompt_idx": i}))
        return out

    def describe(self) -> dict:
        return {"dataset": self.dataset, "seed": self.seed, "prompts": len(self.texts), "kept": len(self.kept),
                "repeats": self.repeats,
                "prompt_len": {a: _len_stats([x for x in self.lengths(a) if x is not None]) for a in self.ids}}


def _len_stats(v: list[int]) -> dict | None:
    if not v:
        return None
    return {"n": len(v), "mean": float(np.mean(v)), "min": int(min(v)), "max": int(max(v))}
