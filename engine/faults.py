"""Named faults for the self-test: each reproduces a real bug class of speculative engines.

Faults are off unless listed in `EngineConfig.faults`; the engine checks membership of a frozenset at a
few fixed points, which costs nothing when the set is empty. `specbench selftest` turns each on and
proves that some gate fails.
"""

from __future__ import annotations

FAULTS: dict[str, str] = {
    "kv_offset": "verify writes its span's K/V one position late (a one-position KV offset)",
    "skip_rollback": "pages of the rejected speculative tail are dropped instead of returned to the pool",
    "wrong_bonus": "the bonus token is taken one position too late in the target's argmax",
    "accept_off_by_one": "one more draft than matched is accepted",
    "draft_ctx_misaligned": "the drafter's context rows are appended one position late",
    "mask_leak": "verify queries see one future key (causal mask leak)",
    "stale_shape": "a verify buffer captured at a short span is replayed for a longer one",
    "emit_past_stop": "tokens after a stop token inside an accepted run are emitted",
    # Sampling faults (speculative sampling)
    "biased_accept": "sampled drafts are accepted with min(1, q/p) instead of min(1, p/q)",
    "resample_from_p": "after a rejection the token is resampled from p instead of the residual",
    "reused_uniform": "one uniform random number is reused across draft positions",
}


def check_faults(names: tuple[str, ...] | list[str]) -> frozenset[str]:
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise ValueError(f"faults={unknown!r} unknown: expected any of {', '.join(FAULTS)}")
    return frozenset(names)
