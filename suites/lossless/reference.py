"""Acceptance references: what a passing run measured for the same engine, drafter, prompts and max_tokens.

A later run of the same fingerprint is held against it (two-sided: checks.check_acceptance), so a change that
moves acceptance, up or down, without a change of engine, drafter or prompts is caught across commits.

Contract:
- `fingerprint(describe, prompts, max_tokens, concurrency)` -> (key, parts). parts: the candidate engine's
  identity without its label, faults or invariant switch (an engine with faults is held against the clean
  engine's reference): kind, model, drafter, method, K, dtype, device and the numerics switches (attention
  backend, Triton, graphs) of a local engine, with a signature of each local directory (config.json's
  sha256, the weight files' names and sizes, so a retrained drafter at the same path is another engine);
  the served model, dialect and server version of a remote one; the prompts' token ids (chat prompts:
  their messages) (sha256), their
  count, max_tokens and the greedy gate's concurrency. key = the first 16 hex digits of sha256(parts).
- `load(key, results)` -> `AcceptanceReference | None`; `record(key, parts, stats, ...)` writes one
  (harness/results.py `write_reference`, kind `KIND`) and returns its path. The suite records only from a
  run whose verdict is PASS, from an engine with no fault armed, when none exists yet or when asked to
  (`--record-reference`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specbench.harness.results import read_reference, write_reference

from .checks import AcceptanceEvidence

KIND = "lossless-acceptance"
LOCAL_KEYS = ("draft", "spec", "k", "dtype", "device", "attention", "triton", "eager", "verify_graph",
              "draft_graph", "decode_attention", "decode_tensor_cores", "gemv")
REMOTE_KEYS = ("dialect",)
# the load-aware levers change acceptance legitimately (a trimmed span accepts fewer drafts): part of the identity
# when set, absent when off (so a lever-free engine keeps the fingerprint it had before the levers existed)
LEVER_KEYS = ("gate", "trim", "policy")


def dir_signature(path: object) -> str | None:
    """sha256 over a checkpoint directory's config.json and its weight files' names and sizes; None if no dir."""
    p = Path(str(path)) if path else None
    if p is None or not p.is_dir():
        return None
    h = hashlib.sha256()
    cfg = p / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(p.glob("*.safetensors")) + sorted(p.glob("*.index.json")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def engine_identity(describe: dict) -> dict:
    config = describe.get("config")
    cfg = config if isinstance(config, dict) else {}
    out: dict = {"kind": describe.get("kind"), "model": describe.get("model")}
    if describe.get("kind") == "local":
        out.update({k: cfg.get(k) for k in LOCAL_KEYS if k in cfg})
        out.update({k: cfg[k] for k in LEVER_KEYS if cfg.get(k) not in (None, 0, "off")})
        if cfg.get("tp_emulate", 1) != 1:  # another reduction order (docs/noise.md): its own reference
            out["tp_emulate"] = cfg["tp_emulate"]
        out["model_sig"] = dir_signature(describe.get("model"))
        out["draft_sig"] = dir_signature(cfg.get("draft"))
        out["model"] = Path(str(describe.get("model"))).name if describe.get("model") else None
        out["draft"] = Path(str(cfg["draft"])).name if cfg.get("draft") else None
    else:
        out.update({k: describe.get(k) for k in REMOTE_KEYS})
        out["server_version"] = describe.get("version")
        out["dtype"] = cfg.get("dtype")
    return out


def fingerprint(describe: dict, prompts: Sequence[Sequence[Any]], max_tokens: int,
                concurrency: int = 1) -> tuple[str, dict]:
    ph = hashlib.sha256(json.dumps([list(p) for p in prompts]).encode()).hexdigest()[:16]
    parts = {"engine": engine_identity(describe), "prompts_sha256": ph, "num_prompts": len(prompts),
             "max_tokens": max_tokens, "concurrency": concurrency}
    key = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return key, parts


@dataclass
class AcceptanceReference:
    key: str
    mean_accept_len: float
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    run_id: str | None
    recorded: str | None
    path: str | None
    parts: dict

    def describe(self) -> str:
        return (f"recorded reference {self.mean_accept_len:.3f} ({self.num_accepted_tokens} accepted / {self.num_drafts} "
                f"drafts) from run {self.run_id or '?'} on {self.recorded or '?'} ({self.path})")


def load(key: str, results: str | Path | None = None) -> AcceptanceReference | None:
    d = read_reference(KIND, key, results)
    if not d or not isinstance(d.get("mean_accept_len"), int | float):
        return None
    return AcceptanceReference(key, float(d["mean_accept_len"]), int(d.get("num_drafts") or 0),
                               int(d.get("num_draft_tokens") or 0), int(d.get("num_accepted_tokens") or 0),
                               d.get("run_id"), d.get("recorded"), d.get("path"), d.get("parts") or {})


def record(key: str, parts: dict, stats: AcceptanceEvidence, run_id: str | None,
           results: str | Path | None = None) -> Path:
    return write_reference(KIND, key, {"key": key, "parts": parts, "mean_accept_len": stats.mean_accept_len,
                                       "num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
                                       "num_accepted_tokens": stats.num_accepted_tokens,
                                       "accepted_per_pos": list(stats.accepted_per_pos), "source": stats.source,
                                       "run_id": run_id}, results)
