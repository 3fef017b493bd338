"""Which speculation a run uses, decided once at start-up: the method, K, the headroom, who may speculate.

The one home of these rules (the front door's `spec` argument is resolved before, by config.py `spec_method`):
- `resolve_spec(cfg, draft_cfg, proposer)`: the run's `SpecPlan`; a given proposer wins over
  `SpecConfig.method` and brings its own K;
- K: a given proposer's own; dflash: `num_speculative_tokens` or block_size - 1 (at most block_size - 1);
  otherwise `num_speculative_tokens` or 4;
- headroom: the positions past a request's committed length that one step may touch: its verify span
  [anchor, d1..dK] (K + 1) and, with a block drafter, the draft block's B scratch slots; the usable
  context is the model's context minus it, and admission promises prompt + max_tokens + headroom slots;
- `SpecPlan.can_speculate`: a request speculates unless it asked for prompt logprobs, or for logprobs while
  speculated logprobs are off (`SpecConfig.logprobs`), or it samples while speculative sampling is off
  (`SpecConfig.sampling`);
- levers (issue 20, spec/policy.py): `gate` (a step with more running requests than that is a one-token
  round), `trim` (k <= K drafts per verify span; refused at start when > K), `policy` ("auto": the cost-model
  span choice); `fixed_drafts` is the draft count without the automatic policy (trim, else K) and
  `span_variants` the verify span lengths a run can take (1, trim + 1, K + 1 and, with the automatic policy,
  `AUTO_SPANS`): the verify graphs hold one graph set per variant and batch bucket;
- `make_proposer`: the proposer the method names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..config import ConfigError, ModelConfig, SamplingParams, SpecConfig
from .proposer import NgramProposer, Proposer

if TYPE_CHECKING:
    from ..kv_cache import PagePool
    from ..models.dflash import DFlashDraftModel
    from ..models.qwen3 import Qwen3ForCausalLM
    from ..runner import ModelRunner

DEFAULT_K = 4  # drafts per step for a method without a block (n-gram)
AUTO_SPANS = (2, 4, 8)  # verify spans the automatic policy may pick besides 1, trim + 1 and K + 1


@dataclass(frozen=True)
class SpecPlan:
    enabled: bool  # some proposer runs (SpecConfig.method set, or a proposer given)
    method: str | None  # SpecConfig.method
    k: int  # drafts per verify step (resolved from the config even when off; `draft_tokens` is 0 then)
    headroom: int  # positions past the committed length one step may touch; 0 when off
    drafter: bool  # the DFlash drafter's context K/V and memory reservation exist
    sampling: bool  # sampled requests speculate (rejection sampling)
    gate: int = 0  # SpecConfig.gate: above this many running requests a step is a one-token round (0 = off)
    trim: int = 0  # SpecConfig.trim: drafts per verify span (0 = off: K)
    policy: str = "off"  # SpecConfig.policy
    logprobs: bool = True  # SpecConfig.logprobs: logprobs requests speculate

    @property
    def fixed_drafts(self) -> int:
        """Drafts per verify span without the automatic policy: trim when set, else K."""
        return self.trim or self.k

    @property
    def span_variants(self) -> tuple[int, ...]:
        """Every verify span length (1 + drafts) a step of this run may take, ascending (() when off)."""
        if not self.enabled:
            return ()
        spans = {1, self.fixed_drafts + 1}
        if self.policy == "auto":
            spans |= {self.k + 1} | {s for s in AUTO_SPANS if s <= self.k + 1}
        return tuple(sorted(spans))

    @property
    def draft_tokens(self) -> int:
        """K when speculation is on, else 0."""
        return self.k if self.enabled else 0

    @property
    def verify_span(self) -> int:
        """The longest verify span (K + 1) when speculation is on, else 0."""
        return self.k + 1 if self.enabled else 0

    def can_speculate(self, p: SamplingParams) -> bool:
        """Could a request with these params ever speculate (so the proposer tracks its context)?"""
        return self.enabled and (p.logprobs is None or self.logprobs) and p.prompt_logprobs is None \
            and (p.greedy or self.sampling)


def resolve_spec(spec: SpecConfig, draft_cfg: ModelConfig | None, proposer: Proposer | None = None) -> SpecPlan:
    """The run's speculation plan; raises ConfigError for a dflash run without a drafter or a K too long
    for its block."""
    enabled = spec.enabled or proposer is not None
    block: int | None = None
    if proposer is not None:
        k, block = proposer.k, proposer.block
    elif spec.method == "dflash":
        if draft_cfg is None:
            raise ConfigError("spec.method='dflash' needs a drafter: pass draft=<dir>")
        assert draft_cfg.block_size is not None  # a DFlash config's block_size is validated (ModelConfig)
        block = draft_cfg.block_size
        k = spec.num_speculative_tokens or block - 1
        if k > block - 1:
            raise ConfigError(f"spec.num_speculative_tokens={k} is invalid: expected <= block_size - 1 = {block - 1}")
    else:
        k = spec.num_speculative_tokens or DEFAULT_K
    if enabled and spec.trim > k:
        raise ConfigError(f"spec.trim={spec.trim} is invalid: expected 0 (off) or 1..K={k} (num_speculative_tokens)")
    headroom = max(k + 1, block or 0) if enabled else 0
    drafter = enabled and spec.method == "dflash" and draft_cfg is not None
    return SpecPlan(enabled, spec.method, k, headroom, drafter, spec.sampling, spec.gate, spec.trim, spec.policy,
                    spec.logprobs)


def make_proposer(plan: SpecPlan, spec: SpecConfig, draft: DFlashDraftModel | None, target: Qwen3ForCausalLM,
                  runner: ModelRunner, pool: PagePool) -> Proposer | None:
    """The proposer `plan` names (None when speculation is off): DFlash for dflash, else n-gram lookup."""
    if not plan.enabled:
        return None
    if plan.method == "dflash":
        from .dflash2 import dflash_proposer  # noqa: PLC0415  (the drafter's code only when it runs)

        assert draft is not None  # resolve_spec refused dflash without a drafter
        return dflash_proposer(plan.k, draft, target, runner, pool, batched=spec.batched_draft)  # by architecture
    return NgramProposer(plan.k, spec.ngram_min, spec.ngram_max, mix=spec.ngram_mix,
                         vocab_size=target.cfg.vocab_size)
