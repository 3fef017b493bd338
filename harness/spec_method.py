"""Which speculative method a run uses: the one rule that engine strings, commands, adapters and labels share.

A run names it as `spec`: "off", "dflash" or "ngram" (engine strings, `--spec` of serve), "on" (the
profile command's switch), or nothing. `spec_method(spec, draft)` resolves it:
- a named method is used as given ("off" = no speculation);
- nothing: "dflash" when a drafter directory is known, else "off" (naming a drafter asks for it);
- "on": "dflash" when a drafter is known, else "ngram" (the proposer that needs no drafter).
`engine_method` turns the resolved name into `SpecConfig.method` (None for off). A "dflash" without a
drafter is returned as is: the builder that has the drafter's path refuses it with the reason.
"""

from __future__ import annotations

SPEC_METHODS = ("off", "dflash", "ngram")


def spec_method(spec: str | None, draft: str | None) -> str:
    if spec is None:
        return "dflash" if draft else "off"
    if spec == "on":
        return "dflash" if draft else "ngram"
    if spec not in SPEC_METHODS:
        raise ValueError(f"spec={spec!r} is invalid: expected one of {', '.join(SPEC_METHODS)} (or on)")
    return spec


def engine_method(method: str) -> str | None:
    """`SpecConfig.method` for a resolved method name: None for off."""
    return None if method == "off" else method
