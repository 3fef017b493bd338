"""A deterministic clock for the span policy (`SpanPolicy.clock`) in tests that compare two engines step by step.

The automatic policy decides from measured wall times (the host overhead, the online step times). Two engines
timed by the real clock can decide differently on one machine and alike on another, so a step-for-step
comparison of them races the machine. `TickClock` reads `tick` seconds later at every call (time moves, each
step has a positive measured time) and `idle(s)` moves it `s` seconds at once (an engine idling between
requests): the same readings on every machine, idle or loaded.
"""

from __future__ import annotations

from typing import Any

TICK_S = 1e-4


class TickClock:
    def __init__(self, tick: float = TICK_S) -> None:
        self.t, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.t += self.tick
        return self.t

    def idle(self, seconds: float) -> None:
        self.t += seconds


def tick_policy(llm: Any) -> TickClock:
    """Put a fresh `TickClock` on the engine's span policy; returns it."""
    clock = TickClock()
    llm.engine.policy.clock = clock
    return clock
