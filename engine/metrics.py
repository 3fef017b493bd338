"""Engine counters and their Prometheus text, with vLLM's metric names.

Spec-decode counters keep REFERENCE.md section 3's invariants by construction: every verify step adds
k to num_draft_tokens and its accepted count m to num_accepted_tokens and to positions 0..m-1 of the
per-position counter, so the per-position counts sum to num_accepted_tokens and are non-increasing.

Gauges (running, waiting, KV usage) are point-in-time values. The engine sets them after each commit;
a reader that renders them (the server's /metrics, the local adapter) refreshes them first with
`set_gauges` from the scheduler and the pool, so a request aborted while nothing else runs (a client
that disconnects) cannot leave them stale: no step follows an abort on an idle engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    # verify steps whose k >= 1 drafts were all accepted (their last token is the bonus, a draw from the row
    # after the last draft); num_drafts - num_full_accepts steps ended on a rejection
    num_full_accepts: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    requests_rejected: int = 0
    steps: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    # load-aware speculation (spec/policy.py): steps whose draft-ready requests were held to one token (the gate
    # or the policy), and steps per chosen span (1 + drafts)
    gated_rounds: int = 0
    span_hist: dict[int, int] = field(default_factory=dict)
    # prefix caching (engine/prefix_share.py): prompt tokens looked up and found (vLLM's counters, in tokens), and
    # prefix hits whose drafter capture was restored or missing (a miss decodes without drafts)
    prefix_queries: int = 0
    prefix_hits: int = 0
    capture_hits: int = 0
    capture_fallbacks: int = 0
    # decode steps (plain, or gated rounds with speculation on) launched one step ahead, before the host read the
    # step on the device (engine/ahead.py)
    decode_ahead_steps: int = 0

    def reset(self) -> None:
        """Every counter and gauge back to zero (the server's warm-up requests are not served traffic)."""
        for name, f in self.__dataclass_fields__.items():
            setattr(self, name, f.default_factory() if callable(f.default_factory) else f.default)

    def record_verify(self, k: int, m: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += m
        if k and m >= k:
            self.num_full_accepts += 1
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos.extend([0] * (k - len(self.accepted_per_pos)))
        for i in range(m):
            self.accepted_per_pos[i] += 1

    def record_span(self, span: int, gated: bool) -> None:
        self.span_hist[span] = self.span_hist.get(span, 0) + 1
        self.gated_rounds += int(gated)

    def set_gauges(self, running: int, waiting: int, free_pages: int, total_pages: int) -> None:
        self.num_running, self.num_waiting = int(running), int(waiting)
        self.kv_usage = 1.0 - free_pages / total_pages if total_pages else 0.0

    def snapshot(self) -> dict:
        return {
            "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
            "num_full_accepts": self.num_full_accepts,
            "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens,
            "requests_finished": self.requests_finished, "steps": self.steps,
            "gated_rounds": self.gated_rounds, "span_hist": dict(self.span_hist),
            "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
            "capture_hits": self.capture_hits, "capture_fallbacks": self.capture_fallbacks,
            "decode_ahead_steps": self.decode_ahead_steps,
        }

    def prometheus(self, model: str) -> str:
        lab = f'model_name="{model}"'
        lines = []

        def counter(name: str, value: float, help_: str, extra: str = "") -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} counter")
            lines.append(f"{name}{{{lab}{extra}}} {value}")

        counter("vllm:spec_decode_num_drafts_total", self.num_drafts, "Number of spec decoding drafts.")
        counter("vllm:spec_decode_num_draft_tokens_total", self.num_draft_tokens, "Number of draft tokens.")
        counter("vllm:spec_decode_num_accepted_tokens_total", self.num_accepted_tokens, "Number of accepted tokens.")
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        lines.append(f"# HELP {name} Accepted tokens per draft position.")
        lines.append(f"# TYPE {name} counter")
        for i, v in enumerate(self.accepted_per_pos):
            lines.append(f'{name}{{{lab},position="{i}"}} {v}')
        counter("vllm:prompt_tokens_total", self.prompt_tokens, "Number of prefill tokens processed.")
        counter("vllm:generation_tokens_total", self.generation_tokens, "Number of generation tokens processed.")
        counter("vllm:request_success_total", self.requests_finished, "Count of successfully processed requests.")
        counter("vllm:prefix_cache_queries_total", self.prefix_queries, "Prefix cache queries, in queried tokens.")
        counter("vllm:prefix_cache_hits_total", self.prefix_hits, "Prefix cache hits, in cached tokens.")
        counter("specbench:spec_capture_hits_total", self.capture_hits,
                "Prefix hits whose drafter context was restored from the capture cache.")
        counter("specbench:spec_capture_fallbacks_total", self.capture_fallbacks,
                "Prefix hits without the drafter's capture: the request decodes without drafts.")
        counter("specbench:spec_gated_rounds_total", self.gated_rounds,
                "Steps whose draft-ready requests verified one token (max-batch gate or span policy).")
        counter("specbench:decode_ahead_steps_total", self.decode_ahead_steps,
                "Decode steps (plain, or gated rounds) launched before the host read the step on the device (decode ahead).")
        name = "specbench:spec_step_span_total"
        lines += [f"# HELP {name} Steps per chosen verify span (1 + drafts).", f"# TYPE {name} counter"]
        for span in sorted(self.span_hist):
            lines.append(f'{name}{{{lab},span="{span}"}} {self.span_hist[span]}')
        for gname, val, h in (("vllm:num_requests_running", self.num_running, "Requests running."),
                              ("vllm:num_requests_waiting", self.num_waiting, "Requests waiting."),
                              ("vllm:kv_cache_usage_perc", self.kv_usage, "KV-cache usage, 0..1.")):
            lines += [f"# HELP {gname} {h}", f"# TYPE {gname} gauge", f"{gname}{{{lab}}} {val}"]
        return "\n".join(lines) + "\n"
