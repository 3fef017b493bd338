"""Sweep workloads: prompts from the bundled data sets (or random text), tokenized once per engine.

Contract:
- `load_texts(dataset, n, seed)` returns n prompt texts in a seeded order: spec_bench / mt_bench
  (first turn), sharegpt (first human turn), humaneval (each task's prompt), gsm8k (test split, lm-eval's "Question: ...\\nAnswer:"
  form, which is also what the bundled tiny pair was trained on), or random (words drawn from the
  bundled prompts: the trap to know is that random prompts understate acceptance). A data set smaller
  than n is cycled; `Workload.repeats` says so.
- `Workload.tokenize(arm, adapter)` tokenizes every prompt once with that engine's own tokenizer (its
  `tokenize`, e.g. /tokenize) and records the lengths. Requests then carry token ids, so no tokenizer
  round trip can change a prompt's length between arms; an engine that cannot tokenize (or answers an
  empty token list for a non-empty text) gets the text and its lengths come from usage. Copies of an arm (the noise-floor arm) share its ids.
- `Workload.keep(max_len)` drops prompts that would not fit an engine's context for EVERY arm at once,
  so all arms always run the same prompts.
- The user's own prompts (`dataset_path`, vLLM bench's --dataset-path): `custom` reads JSONL with a
  "prompt" string per line, `sharegpt` a ShareGPT JSON list (first human turn of each conversation),
  `spec_bench` / `mt_bench` JSONL with "turns" (first turn). A bad file raises WorkloadError naming the
  path, the line and what was expected.
- `random` prompts are `random_input_len` TOKENS long for every engine that tokenizes: words are drawn,
  tokenized by that engine, and the ids cut to exactly that length (an engine that cannot tokenize gets
  that many words, and `describe()["random_exact"]` says so per arm).
- `shared_prefix`: the gsm8k questions behind one shared system prompt of about 1,000 tokens
  (`SHARED_PREFIX`), the workload of docs/prefix-cache.md: with a prefix cache every request after the first
  computes only its question (arms `local,...` and `local,...,prefix_cache=0` give warm against off).
- `chat=True` (--endpoint-type chat) sends every prompt as one user message, so the server applies its
  chat template; ids are then used for lengths only and prompt tokens come from usage.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specbench.harness.adapters.base import EngineAdapter, GenRequest
from specbench.harness.datasets import BUNDLED, SYNTHETIC, bundled_prompts

DATASETS = BUNDLED + SYNTHETIC  # humaneval included: the same names as lossless
_SYSTEM = ("You are a careful assistant for grade-school mathematics. Read each question twice, write down the "
           "quantities it gives, reason one step at a time, check every calculation, and end with the answer on "
           "its own line. ")
SHARED_PREFIX = _SYSTEM * 20  # ~4,000 characters: about 1,000 tokens with a BPE tokenizer of English
FILE_DATASETS = ("custom", "sharegpt", "spec_bench", "mt_bench")  # the ones --dataset-path can feed


class WorkloadError(ValueError):
    """Bad workload input (unknown data set, impossible sizes); the message names the option."""


def output_len_range(max_tokens: int, spread: float) -> tuple[int, int]:
    """[lo, hi] of the per-request max_tokens with an output length spread (SweepConfig.max_tokens_spread)."""
    return max(1, round(max_tokens * (1.0 - spread))), max(1, round(max_tokens * (1.0 + spread)))


def file_texts(dataset: str, path: str | Path) -> list[str]:
    """Every prompt of the user's file for `dataset` (see the module contract), in file order."""
    p = Path(path)
    if dataset not in FILE_DATASETS:
        raise WorkloadError(f"--dataset-path works with --dataset-name {', '.join(FILE_DATASETS)}, not {dataset!r}")
    if not p.is_file():
        raise WorkloadError(f"--dataset-path {str(p)!r}: no such file")
    text = p.read_text(encoding="utf-8")
    out: list[str] = []
    if dataset == "sharegpt":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"--dataset-path {str(p)!r}: not JSON ({e}): expected a ShareGPT list of "
                                '{"conversations": [{"from": "human", "value": ...}, ...]}') from None
        if not isinstance(rows, list):
            raise WorkloadError(f"--dataset-path {str(p)!r}: expected a JSON list of conversations, got "
                                f"{type(rows).__name__}")
        for r in rows:
            turns = [c.get("value") for c in (r.get("conversations") or []) if isinstance(c, dict)
                     and c.get("from") == "human" and c.get("value")] if isinstance(r, dict) else []
            if turns:
                out.append(str(turns[0]))
    else:
        want = "prompt" if dataset == "custom" else "turns"
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"--dataset-path {str(p)!r} line {i}: not JSON ({e}): expected JSONL, one "
                                    f'{{"{want}": ...}} object per line') from None
            v = r.get(want) if isinstance(r, dict) else None
            if dataset == "custom" and isinstance(v, str) and v:
                out.append(v)
            elif dataset != "custom" and isinstance(v, list) and v and isinstance(v[0], str):
                out.append(v[0])
            else:
                shape = "a non-empty string" if dataset == "custom" else "a non-empty list of strings"
                raise WorkloadError(f"--dataset-path {str(p)!r} line {i}: field {want!r} is {v!r}: expected {shape}")
    if not out:
        raise WorkloadError(f"--dataset-path {str(p)!r}: no prompt in it")
    return out


def dataset_texts(dataset: str) -> list[str]:
    """Every prompt of a bundled data set, in file order."""
    if dataset == "custom":
        raise WorkloadError("--dataset-name custom needs --dataset-path (JSONL, one {\"prompt\": ...} per line)")
    if dataset not in DATASETS or dataset == "random":
        raise WorkloadError(f"--dataset {dataset!r} is invalid: expected one of {', '.join(DATASETS)}")
    try:
        if dataset == "shared_prefix":
            return [SHARED_PREFIX + text for _, text in bundled_prompts("gsm8k")]
        return [text for _, text in bundled_prompts(dataset)]
    except FileNotFoundError as e:
        raise WorkloadError(str(e)) from None


def random_texts(n: int, words: int, seed: int) -> list[str]:
    """n prompts of `words` words drawn uniformly from the vocabulary of the bundled prompts."""
    vocab = sorted({w for t in dataset_texts("spec_bench") for w in re.findall(r"[A-Za-z]+", t)})
    rng = np.random.default_rng(seed)
    return [" ".join(vocab[i] for i in rng.integers(0, len(vocab), size=words)) for _ in range(n)]


def load_texts(dataset: str, n: int, seed: int = 0, random_words: int = 64,
               path: str | Path | None = None) -> tuple[list[str], int]:
    """(n texts in a seeded order, how many times the data set had to be repeated to reach n)."""
    if n < 1:
        raise WorkloadError(f"number of prompts {n} is invalid: expected >= 1")
    if dataset == "random":
        if path is not None:
            raise WorkloadError("--dataset-path cannot be used with --dataset-name random: pick custom, sharegpt "
                                "or spec-bench for a file")
        return random_texts(n, random_words, seed), 1
    texts = file_texts(dataset, path) if path is not None else dataset_texts(dataset)
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
    exact_len: int | None = None  # random prompts: ids cut to this many tokens
    chat: bool = False  # send chat messages (ids for lengths only)
    path: str | None = None
    exact: dict[str, bool] = field(default_factory=dict)  # arm -> whether its random prompts are exactly exact_len

    @classmethod
    def build(cls, dataset: str, n: int, seed: int = 0, random_words: int = 64, path: str | Path | None = None,
              chat: bool = False) -> Workload:
        texts, reps = load_texts(dataset, n, seed, random_words, path)
        return cls(dataset=dataset, texts=texts, seed=seed, repeats=reps, kept=list(range(len(texts))),
                   exact_len=random_words if dataset == "random" else None, chat=chat,
                   path=str(path) if path is not None else None)

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

        ids = list(await asyncio.gather(*(one(t) for t in self.texts)))
        if self.exact_len is not None:
            ids = [None if x is None else x[: self.exact_len] for x in ids]
            self.exact[arm] = all(x is not None and len(x) == self.exact_len for x in ids)
        self.ids[arm] = ids

    def share(self, arm: str, copy: str) -> None:
        self.ids[copy] = self.ids[arm]
        if arm in self.exact:
            self.exact[copy] = self.exact[arm]

    def lengths(self, arm: str) -> list[int | None]:
        ids = self.ids.get(arm) or [None] * len(self.texts)
        return [None if x is None else len(x) for x in ids]

    def keep(self, max_len: dict[str, int | None]) -> int:
        """Keep prompts whose length fits max_len[arm] for every arm; returns how many were dropped."""
        before = len(self.kept)
        lens = {a: self.lengths(a) for a in max_len}
        self.kept = [i for i in self.kept
                     if all(m is None or (n := lens[a][i]) is None or n <= m for a, m in max_len.items())]
        return before - len(self.kept)

    def requests(self, arm: str, positions: list[int], max_tokens: int, ignore_eos: bool,
                 temperature: float = 0.0, meta: dict | None = None, spread: float = 0.0,
                 seed: int = 0) -> list[GenRequest]:
        """Requests for the kept prompts at `positions` (indices into `kept`, wrapped around). `spread`: each
        request's max_tokens drawn from `output_len_range(max_tokens, spread)` by (seed, position), so every arm
        and round gets the same length at the same position."""
        if not self.kept:
            raise WorkloadError("no prompt fits the engines' context: lower --max-tokens or pick another --dataset")
        ids = self.ids.get(arm)
        out = []
        for p in positions:
            i = self.kept[p % len(self.kept)]
            m = {**(meta or {}), "prompt_idx": i}
            if spread:
                lo, hi = output_len_range(max_tokens, spread)
                n = random.Random(f"{seed}:{p}").randint(lo, hi)
                m["max_tokens"] = n
            else:
                n = max_tokens
            if self.chat:
                out.append(GenRequest(messages=[{"role": "user", "content": self.texts[i]}], max_tokens=n,
                                      temperature=temperature, ignore_eos=ignore_eos, meta=m))
                continue
            prompt = ids[i] if ids and ids[i] is not None else self.texts[i]
            out.append(GenRequest(prompt=prompt, max_tokens=n, temperature=temperature,
                                  ignore_eos=ignore_eos, meta=m))
        return out

    def describe(self) -> dict:
        extra: dict = {}
        if self.exact_len is not None:
            extra = {"random_input_len": self.exact_len, "length_unit": "tokens", "random_exact": dict(self.exact)}
        return {"dataset": self.dataset, "seed": self.seed, "prompts": len(self.texts), "kept": len(self.kept),
                "repeats": self.repeats, "path": self.path, "chat": self.chat, **extra,
                "prompt_len": {a: _len_stats([x for x in self.lengths(a) if x is not None]) for a in self.ids}}


def _len_stats(v: list[int]) -> dict | None:
    if not v:
        return None
    return {"n": len(v), "mean": float(np.mean(v)), "min": int(min(v)), "max": int(max(v))}
