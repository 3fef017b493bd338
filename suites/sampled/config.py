"""Options of the sampled gate: sampling configs, `SampledGateOptions`, and the bad-input error.

Contract: `parse_configs` and `SampledGateOptions` validate everything a user can type and raise `SampledError`
(a ValueError; the CLI turns it into exit code 2) naming the option, the value and what is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PROMPT_SETS = ("gsm8k", "echo", "repeat")
END = -1  # a sample's position the engine did not reach (gate.py's token matrices; fit.py stops there)
ENDPOINT_TYPES = ("completions", "chat")  # the sweep's --endpoint-type vocabulary


class SampledError(ValueError):
    """Bad input to the sampled gate; the message names the option and what would be accepted."""


@dataclass(frozen=True)
class SamplingConfig:
    name: str
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    # penalties (engine/config.py SamplingParams): the law compared is the penalized one, on both arms
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def penalties(self) -> dict[str, float]:
        """The request keywords of the penalties this config sets (none by default)."""
        return {k: v for k, v in (("repetition_penalty", self.repetition_penalty),
                                  ("presence_penalty", self.presence_penalty),
                                  ("frequency_penalty", self.frequency_penalty)) if v != (1.0 if k[0] == "r" else 0.0)}


_KEYS = {"t": "temperature", "temperature": "temperature", "p": "top_p", "top_p": "top_p", "k": "top_k",
         "top_k": "top_k", "rp": "repetition_penalty", "repetition_penalty": "repetition_penalty",
         "pp": "presence_penalty", "presence_penalty": "presence_penalty", "fp": "frequency_penalty",
         "frequency_penalty": "frequency_penalty"}


def parse_configs(text: str) -> list[SamplingConfig]:
    """'t=1.0;t=0.7,p=0.9;t=1,k=20,fp=0.5' -> configs (keys t|temperature, p|top_p, k|top_k, and the penalties
    rp|repetition_penalty, pp|presence_penalty, fp|frequency_penalty)."""
    out = []
    for part in [s.strip() for s in text.split(";") if s.strip()]:
        kw: dict[str, float] = {}
        for item in part.split(","):
            key, eq, val = item.partition("=")
            if not eq or key.strip() not in _KEYS:
                raise SampledError(f"--configs item {item!r} is invalid: expected key=value with key one of "
                                   "t, p, k, rp, pp, fp (temperature, top_p, top_k, repetition / presence / "
                                   "frequency penalty), configs separated by ';'")
            try:
                kw[_KEYS[key.strip()]] = float(val)
            except ValueError:
                raise SampledError(f"--configs value {val!r} for {key.strip()} is not a number") from None
        t, p, k = kw.get("temperature", 1.0), kw.get("top_p", 1.0), kw.get("top_k", 0.0)
        if not (t > 0 and math.isfinite(t)):
            raise SampledError(f"--configs temperature={t} is invalid: expected > 0 (greedy has its own gate)")
        if not 0 < p <= 1 or k < 0 or k != int(k):
            raise SampledError(f"--configs {part!r}: expected 0 < top_p <= 1 and an integer top_k >= 0")
        rp, pp, fp = kw.get("repetition_penalty", 1.0), kw.get("presence_penalty", 0.0), kw.get("frequency_penalty", 0.0)
        if not (rp > 0 and math.isfinite(rp)) or not -2 <= pp <= 2 or not -2 <= fp <= 2:
            raise SampledError(f"--configs {part!r}: expected rp > 0 and pp, fp in [-2, 2]")
        name = f"t{t:g}" + (f"-p{p:g}" if p < 1 else "") + (f"-k{int(k)}" if k else "") + \
            (f"-rp{rp:g}" if rp != 1 else "") + (f"-pp{pp:g}" if pp else "") + (f"-fp{fp:g}" if fp else "")
        out.append(SamplingConfig(name, t, p, int(k), rp, pp, fp))
    if not out:
        raise SampledError("--configs is empty: expected e.g. 't=1.0;t=0.7,p=0.9'")
    return out


# The default sampling configs: T 0.6 with top-p, T 0.7 alone (a temperature with no truncation: a verify path
# that skips the transform when no top-k / top-p / min-p is set is reached by no other), T 1.3 with top-k
# (docs/sampled.md "The default configuration set": on the echo and repeat prompts every config reaches both
# accept-path branches).
DEFAULT_CONFIGS_TEXT = "t=0.6,p=0.95;t=0.7;t=1.3,k=3"
DEFAULT_CONFIGS = tuple(parse_configs(DEFAULT_CONFIGS_TEXT))
# The default candidates on the bundled target (label, local engine-string options): the n-gram proposer with
# a soft q (q not one-hot, rows differing per position: the accept reads q rows and residuals), the bundled
# DFlash drafter, and the bundled DFlash2 drafter (its sampled drafts walk the candidate selector: q is the
# selector's tempered path distribution). The drafters are skipped where not installed ("draft": which bundled
# drafter, cli/sampled.py). All against the one spec-off baseline.
SOFT_Q_MIX = "0.05"
DEFAULT_CANDIDATES: tuple[tuple[str, dict[str, str]], ...] = (
    ("ngram-soft", {"spec": "ngram", "mix": SOFT_Q_MIX}), ("dflash", {"spec": "dflash", "draft": "dflash"}),
    ("dflash2", {"spec": "dflash", "draft": "dflash2"}))


# Noise between a candidate's logits and the baseline's scores that the fit test (fit.py) tolerates at a support
# boundary, in logit units (--fit-margin): fp32 engines differ by about 1e-5 between batch shapes, bf16 ones by
# 1e-2 and more. Too small a margin shows as the control's own tokens outside the support (the fit is then
# CANNOT TEST, never FAIL).
FIT_MARGIN = 0.02


@dataclass(frozen=True)
class SampledGateOptions:
    num_prompts: int = 2  # of each prompt set
    positions: int = 8
    samples: int = 256
    permutations: int = 1999
    q: float = 0.05
    null: bool = False
    seed: int = 0
    concurrency: int = 128
    refine: bool = True
    prompt_chars: int = 400
    power: float = 0.8
    # comma-separated prompt sets (prompts.py), num_prompts of each: gsm8k questions; echo (question, the
    # baseline's greedy answer, the question again); repeat (a question, then a run of one repeated digit)
    prompt_set: str = "echo,repeat"
    endpoint_type: str = "completions"  # "chat": each prompt as one user message, the server's chat template
    # seeded samples of each arm sent again in one batch of mixed parameters and compared with their first draws
    # (0 = off): a candidate whose seeded requests stop reproducing (its spec path ignores the request's
    # generator, or mixes up rows' sampling parameters) fails (gate.seed_repeat)
    seed_repeat: int = 128
    # the seed repeat's FAIL fails the gate (else it is advisory: reported, noted, the verdict left to the law).
    # Off by default: an engine whose speculation adapts to load (a max-batch gate, an automatic span policy)
    # draws a seeded request differently in another batch by design, with its law exact
    seed_repeat_gate: bool = False
    # the user asserts the candidate speculates: where nothing shows it (no counters, no per-request draft counts,
    # no streamed chunk of several tokens) the verdict is "PASS (speculation asserted by the user, not observed)"
    # instead of CANNOT TEST (--assume-speculating)
    assume_speculating: bool = False
    # the one-sample fit test (fit.py): each candidate sample scored by the baseline, token by token, against the
    # target's own law at its prefix (--fit/--no-fit), with fit_margin logits of noise allowed at a support
    # boundary (--fit-margin)
    fit: bool = True
    fit_margin: float = FIT_MARGIN

    def __post_init__(self) -> None:
        for name, lo in (("num_prompts", 1), ("positions", 1), ("samples", 2), ("permutations", 19),
                         ("concurrency", 1), ("seed_repeat", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                raise SampledError(f"--{name.replace('_', '-')} {v!r} is invalid: expected an integer >= {lo}")
        if not (isinstance(self.fit_margin, int | float) and math.isfinite(self.fit_margin) and self.fit_margin >= 0):
            raise SampledError(f"--fit-margin {self.fit_margin!r} is invalid: expected a number >= 0 (logits)")
        if not 0 < self.q < 1:
            raise SampledError(f"--q {self.q} is invalid: expected 0 < q < 1")
        if self.endpoint_type not in ENDPOINT_TYPES:
            raise SampledError(f"--endpoint-type {self.endpoint_type!r} is invalid: expected completions or chat")
        sets = self.prompt_sets
        if not sets or any(s not in PROMPT_SETS for s in sets) or len(set(sets)) < len(sets):
            raise SampledError(f"--prompt-set {self.prompt_set!r} is invalid: expected one or more of "
                               f"{', '.join(PROMPT_SETS)}, comma-separated, each once")

    @property
    def prompt_sets(self) -> tuple[str, ...]:
        return tuple(s.strip() for s in self.prompt_set.split(",") if s.strip())
