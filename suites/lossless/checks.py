"""Checks around every lossless run: counters, nothing after EOS, speculation silently off, KV leaks.

Contract: each check is a pure function of what a run observed (results, a counters delta, a health
snapshot) and returns a `Check` (name, ok, detail); none raises on bad engine output. The speculation
check returns an `AcceptanceEvidence` whose `speculating` is False when the engine never drafted or its mean
accepted length is within `min_accept_len` of 1.0: a lossless pass on such an engine proves nothing and
the verdict says "NOT SPECULATING", never a plain PASS.

Counter invariants (REFERENCE.md section 3), over a counters delta {num_drafts, num_draft_tokens,
num_accepted_tokens, accepted_per_pos}:
- sum(accepted_per_pos) == num_accepted_tokens;
- accepted_per_pos is non-increasing (a draft at position i+1 is only accepted after position i);
- accepted_per_pos[0] <= num_drafts and num_accepted_tokens <= num_draft_tokens;
- num_draft_tokens <= K x num_drafts, where K = the configured number of speculative tokens. Equality is
  NOT required: a request within K tokens of its max_tokens drafts only remaining - 1 tokens (the
  truncated span), so the product is an upper bound. With K unknown, the length of accepted_per_pos
  (the largest draft length the engine reported) stands in for it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specbench.harness.adapters.base import GenResult

MIN_ACCEPT_LEN = 1.05  # mean accepted length (incl. the bonus token) at or below this = not speculating


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False  # the engine does not expose what the check needs

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class AcceptanceEvidence:
    """Speculation during one run, from per-request stats (preferred) or a counters delta."""

    source: str  # "per-request" | "counters" | "none"
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    min_accept_len: float = MIN_ACCEPT_LEN

    @property
    def known(self) -> bool:
        return self.source != "none"

    @property
    def mean_accept_len(self) -> float | None:
        """Token-weighted acceptance length: 1 + accepted / drafts (REFERENCE.md section 3)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def speculating(self) -> bool | None:
        if not self.known:
            return None
        m = self.mean_accept_len
        return m is not None and m > self.min_accept_len

    def describe(self) -> str:
        if not self.known:
            return "speculation unverified: the engine reports no spec counters"
        if not self.num_drafts:
            return "NOT SPECULATING: zero drafts"
        m = self.mean_accept_len or 1.0
        s = f"{self.num_drafts} drafts, mean accepted length {m:.2f}"
        return s if self.speculating else f"NOT SPECULATING: {s} (<= {self.min_accept_len:.2f})"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(mean_accept_len=self.mean_accept_len, acceptance_rate=self.acceptance_rate,
                 speculating=self.speculating)
        return d


def acceptance_evidence(results: Iterable[GenResult], delta: dict | None,
               min_accept_len: float = MIN_ACCEPT_LEN) -> AcceptanceEvidence:
    """Per-request spec dicts when every ok result has one with a verify-step count (`num_drafts`), else the
    counters delta, else unknown. (llama.cpp's per-request `timings` give draft tokens but no steps, so its
    evidence comes from the `llamacpp:` counters.)"""
    rs = [r for r in results if r.ok]
    if rs and all(r.spec and r.spec.get("num_drafts") is not None for r in rs):
        st = AcceptanceEvidence("per-request", min_accept_len=min_accept_len)
        for r in rs:
            sp = r.spec or {}
            st.num_drafts += int(sp.get("num_drafts") or 0)
            st.num_draft_tokens += int(sp.get("num_draft_tokens") or 0)
            st.num_accepted_tokens += int(sp.get("num_accepted_tokens") or 0)
            pp = list(sp.get("accepted_per_pos") or [])
            st.accepted_per_pos = [a + b for a, b in zip(_pad(st.accepted_per_pos, len(pp)),
                                                         _pad(pp, len(st.accepted_per_pos)), strict=True)]
        return st
    if delta and delta.get("num_drafts") is not None:
        return AcceptanceEvidence("counters", int(delta.get("num_drafts") or 0), int(delta.get("num_draft_tokens") or 0),
                         int(delta.get("num_accepted_tokens") or 0), list(delta.get("accepted_per_pos") or []),
                         min_accept_len)
    return AcceptanceEvidence("none", min_accept_len=min_accept_len)


def _pad(xs: list[int], n: int) -> list[int]:
    return xs + [0] * max(0, n - len(xs))


def check_counters(stats: AcceptanceEvidence, k: int | None = None) -> Check:
    name = "counters"
    if not stats.known:
        return Check(name, True, "no spec counters exposed", skipped=True)
    pp, d, dt, a = stats.accepted_per_pos, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
    bad: list[str] = []
    if pp and sum(pp) != a:
        bad.append(f"sum(accepted_per_pos)={sum(pp)} != num_accepted_tokens={a}")
    inc = [i for i in range(1, len(pp)) if pp[i] > pp[i - 1]]
    if inc:
        bad.append(f"accepted_per_pos increases at position {inc[0]} ({pp[inc[0] - 1]} -> {pp[inc[0]]})")
    if pp and pp[0] > d:
        bad.append(f"accepted_per_pos[0]={pp[0]} > num_drafts={d}")
    if a > dt:
        bad.append(f"num_accepted_tokens={a} > num_draft_tokens={dt}")
    kk = k if k else (len(pp) or None)
    if kk and dt > kk * d:
        bad.append(f"num_draft_tokens={dt} > K x num_drafts = {kk} x {d}")
    if bad:
        return Check(name, False, "; ".join(bad))
    note = f"K={kk}: draft tokens {dt} <= {kk} x {d} drafts (== unless spans were truncated near max_tokens)" \
        if kk else "no drafts"
    return Check(name, True, note)


def check_after_stop(results: Sequence[GenResult], eos_ids: set[int], ignore_eos: bool = False) -> Check:
    """Nothing is emitted after an EOS token, and a request that stopped has no tokens past the stop."""
    name = "after-eos"
    if not eos_ids or ignore_eos:
        return Check(name, True, "no EOS ids known" if not eos_ids else "ignore_eos", skipped=True)
    bad = []
    for r in results:
        ids = r.output_ids or []
        hits = [i for i, t in enumerate(ids) if t in eos_ids]
        if hits and hits[0] < len(ids) - 1:
            bad.append(f"{r.rid}: {len(ids) - 1 - hits[0]} token(s) after EOS at position {hits[0]}")
    return Check(name, not bad, "; ".join(bad[:5]) or f"no token after an EOS in {len(results)} outputs")


def check_speculating(stats: AcceptanceEvidence) -> Check:
    if not stats.known:
        return Check("speculating", True, stats.describe(), skipped=True)
    return Check("speculating", bool(stats.speculating), stats.describe())


def check_acceptance(stats: AcceptanceEvidence, reference: float | None, rel_tol: float = 0.10) -> Check:
    """Mean accepted length must not fall more than rel_tol below a reference (a clean run, a record)."""
    name = "acceptance"
    m = stats.mean_accept_len
    if reference is None or m is None:
        return Check(name, True, "no reference acceptance" if reference is None else "no drafts", skipped=True)
    floor = 1.0 + (reference - 1.0) * (1.0 - rel_tol)
    ok = m >= floor
    return Check(name, ok, f"mean accepted length {m:.3f} vs reference {reference:.3f} (floor {floor:.3f})")


def check_kv_idle(health: dict | None) -> Check:
    """With nothing running or waiting, every KV page must be back in the pool."""
    name = "kv-leak"
    if not health or health.get("kv_total_pages") is None:
        return Check(name, True, "the engine exposes no KV pool snapshot", skipped=True)
    free, total = health["kv_free_pages"], health["kv_total_pages"]
    busy = (health.get("running") or 0) + (health.get("waiting") or 0)
    if busy:
        return Check(name, False, f"{busy} request(s) still running or waiting after the run")
    return Check(name, free == total, f"{free}/{total} pages free when idle"
                 + ("" if free == total else f": {total - free} page(s) leaked"))


def eos_ids_of(describe: dict) -> set[int]:
    """EOS ids of a local/hf model directory (config.json + generation_config.json); empty if unknown."""
    model = describe.get("model")
    out: set[int] = set()
    if not model or not Path(str(model)).is_dir():
        return out
    for fname in ("config.json", "generation_config.json"):
        f = Path(str(model)) / fname
        try:
            v = json.loads(f.read_text()).get("eos_token_id") if f.is_file() else None
        except (json.JSONDecodeError, OSError):
            v = None
        if isinstance(v, int):
            out.add(v)
        elif isinstance(v, list):
            out |= {int(x) for x in v if isinstance(x, int)}
    return out
