"""The engine gates, one module per gate: scenarios that have broken real speculative engines, each judged by
the greedy rule.

Contract: every gate is `async (baseline, candidate, prompts, max_tokens, opts) -> GateRun` (outcomes.py), whose
verdict is FAIL when any request fails the regret rule or any run check fails; each module's docstring is its
gate's contract. Every gate applies the tolerance `greedy.resolve_rule` decides (strict in fp32, else the
margin). common.py holds what several gates share. suites/lossless/registry.py names them (`GATES`), with
what each needs and the faults it is meant to catch, in the order the suite runs them.
"""
