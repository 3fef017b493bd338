"""Request state: token ids, phase, output, timings and spec statistics. No torch here.

A request's `all_ids` is prompt + committed output. `num_computed` counts positions whose KV is in the
cache (and committed). Prefill runs while num_computed < len(prompt); afterwards each step appends the
tokens it commits. Nothing is appended after a finish (EOS, stop token, stop string, length).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from .config import SamplingParams
from .detok import IncrementalText
from .stops import StopScan


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    drafts: int = 0  # verify steps that carried at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_runs: list[int] = field(default_factory=list)  # accepted drafts per verify step
    accepted_per_pos: list[int] = field(default_factory=list)
    step_at: list[int] = field(default_factory=list)  # per verify step: output tokens committed before it
    step_drafts: list[int] = field(default_factory=list)  # per verify step: drafts it verified

    def record(self, k: int, accepted: int, at: int | None = None) -> None:
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += accepted
        self.accepted_runs.append(accepted)
        if at is not None:
            self.step_at.append(at)
            self.step_drafts.append(k)
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos.extend([0] * (k - len(self.accepted_per_pos)))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accept_len(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_tokens, "accepted_runs": list(self.accepted_runs),
                "step_at": list(self.step_at), "step_drafts": list(self.step_drafts),
                "accepted_per_pos": list(self.accepted_per_pos), "mean_accept_len": self.mean_accept_len}


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    phase: Phase = Phase.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Per output position: (chosen logprob, {token: logprob} top-k) when logprobs were requested.
    logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # emission time of each output token
    first_scheduled: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    draft_ready: bool = False  # the drafter holds this request's context features
    stop_scan: StopScan | None = None  # engine/stops.py: where the stop strings' automaton is (OutputWriter)
    truncate_text_at: int | None = None  # set when a stop string ends the text mid-token
    detok: IncrementalText | None = None  # engine/detok.py IncrementalText: the streamed text in O(new tokens) (OutputWriter)
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (engine/prefix_share.py)
    capture_fallback: bool = False  # a prefix hit without the drafter's capture: decodes without drafts
    error: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """all_ids[i] without building the list (the scheduler reads one token per request per step)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.phase = Phase.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
