"""Losslessness suites: is speculation lossless, and does the proof have teeth?

- regret.py: the pure regret rule (benign tie flip vs FAIL, lower bound outside the top-k).
- greedy.py: the greedy gate with re-anchoring after benign flips.
- outcomes.py: the gate's outcome records (`Prompt`, `Divergence`, `PromptCheck`); `GateRun` and its verdict.
- concurrent.py: staggered max_tokens in one batch, each against its own sequential baseline.
- gates/: the engine gates, one module each (short-then-long, mixed, stop and EOS inside an accepted run, abort
  in flight, penalties, logit bias, min_tokens, long contexts, headroom; docs/lossless.md describes each).
- registry.py: every gate's record (name, function, needs, when it runs, the faults it is meant to catch);
  `GATES`, the self-test's gates and the docs follow it.
- checks.py: counter invariants, nothing after EOS, speculation-silently-off alarm, KV leaks.
- selftest.py: every named engine fault must be caught by some gate; the clean engine never alarms.
- report.py: markdown and JSON renderings (pure functions of the runs).
See docs/lossless.md.
"""

from .greedy import GateRun, GreedyGateOptions, LosslessError, Prompt, PromptCheck, check_output, run_greedy
from .regret import MARGIN_TOL, PickJudgement, first_divergence, judge_pick

__all__ = ["MARGIN_TOL", "GreedyGateOptions", "GateRun", "LosslessError", "PickJudgement", "Prompt", "PromptCheck",
           "check_output", "first_divergence", "judge_pick", "run_greedy"]
