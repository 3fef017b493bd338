"""Output assembly: committed tokens appended with stop handling, detokenization, `RequestOutput`.

Contract: `OutputWriter.append(req, tokens, logprobs)` appends a step's tokens in order and finishes the
request at the first stop: EOS (unless ignore_eos; the model's, its generation_config's and the
tokenizer's), a stop token id, a stop string (the text is cut there, or after it with
include_stop_str_in_output), or max_tokens; none of the stops before the request's min_tokens-th token (vLLM's
rule: a stop string whose text ends earlier never stops it). Nothing is appended after a finish, so a stop inside an
accepted run of drafts ends the request there (`past_stop` and `stop_ids_at_end` are the self-test's knobs
that break this: tokens past a stop emitted; EOS and stop ids seen only as a run's last token).
`build(req, new)` is the request's snapshot after a step: the text is decoded in full once finished,
else up to the last complete character, incrementally (engine/detok.py; `incremental=False` decodes the whole
output each step with `Tokenizer.decode_prefix_safe`), less the end that may still become a stop string (unless
include_stop_str_in_output, as vLLM does), so a stream never shows any part of a stop. Stop strings are found in
the same partial text by the request's automaton (engine/stops.py): each step costs O(the characters it added),
whatever the number and length of the stops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specbench.eos import eos_ids as model_eos_ids

from .detok import IncrementalText
from .metrics import EngineMetrics
from .request import Request
from .stops import StopScan, stop_set
from .tokenizer import Tokenizer


@dataclass
class RequestOutput:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None
    new_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)
    spec: dict = field(default_factory=dict)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None


def eos_ids(model_dir: str, tokenizer: Tokenizer) -> set[int]:
    """Every id that ends a generation: config.json's, generation_config.json's and the tokenizer's, by
    specbench/eos.py's rule (the one the lossless suite checks against), the tokenizer's EOS looked up in the
    tokenizer already loaded."""
    return model_eos_ids(model_dir, tokenizer.token_to_id)


class OutputWriter:
    def __init__(self, tokenizer: Tokenizer, eos: set[int], metrics: EngineMetrics, incremental: bool = True) -> None:
        self.tokenizer, self.eos, self.metrics = tokenizer, eos, metrics
        self.incremental = incremental  # engine/detok.py: O(new tokens) text per step; False = decode in full

    def partial_text(self, req: Request) -> str:
        """The text of an unfinished request: incremental (engine/detok.py) or, off, decoded in full."""
        if not self.incremental:
            return self.tokenizer.decode_prefix_safe(req.output_ids)
        if req.detok is None:
            req.detok = IncrementalText()
        return req.detok.advance(self.tokenizer, req.output_ids)

    def append(self, req: Request, toks: list[int], lps: list | None, past_stop: bool = False,
               stop_ids_at_end: bool = False, stop_strings_at_end: bool = False,
               eos_ignored_at_end_only: bool = False) -> None:
        now = time.perf_counter()
        p = req.params
        last = len(toks) - 1
        for i, t in enumerate(toks):
            if req.finished and not past_stop:
                break
            req.output_ids.append(t)
            req.token_times.append(now)
            self.metrics.generation_tokens += 1
            if lps is not None:
                req.logprobs.append(lps[i])
            if req.finished:
                continue
            if len(req.output_ids) < p.min_tokens:  # vLLM: no stop of any kind before min_tokens tokens
                if p.stop:  # the scan moves on: a stop whose text ends before min_tokens never stops it
                    self._scan(req).scan(self._text_so_far(req), self.incremental)
                continue
            ids_seen = not stop_ids_at_end or i == last
            ignore_eos = p.ignore_eos and (not eos_ignored_at_end_only or i == last)  # (the fault's rule)
            if ids_seen and not ignore_eos and t in self.eos:
                req.finish("stop", None)
            elif ids_seen and t in p.stop_token_ids:
                req.finish("stop", t)
            elif p.stop and (not stop_strings_at_end or i == last) and self._stop_string(req):
                pass
            elif len(req.output_ids) >= p.max_tokens:
                req.finish("length")
        if not req.finished and len(req.output_ids) >= p.max_tokens:
            req.finish("length")

    def _text_so_far(self, req: Request) -> str:
        return self.partial_text(req) if self.incremental else self.tokenizer.decode(req.output_ids)

    def _scan(self, req: Request) -> StopScan:
        if req.stop_scan is None:
            req.stop_scan = StopScan(stop_set(req.params.stop))
        return req.stop_scan

    def _stop_string(self, req: Request) -> bool:
        hit = self._scan(req).scan(self._text_so_far(req), self.incremental)
        if hit is None:
            return False
        i, stop = hit
        req.truncate_text_at = i + (len(stop) if req.params.include_stop_str_in_output else 0)
        req.finish("stop", stop)
        return True

    def visible_text(self, req: Request) -> str:
        """An unfinished request's text less its end that is a proper prefix of a stop string."""
        text = self.partial_text(req)
        if req.params.stop and not req.params.include_stop_str_in_output:
            text = text[: len(text) - self._scan(req).holdback(text)]
        return text

    def text_of(self, req: Request) -> str:
        text = self.tokenizer.decode(req.output_ids)
        return text[: req.truncate_text_at] if req.truncate_text_at is not None else text

    def build(self, req: Request, new: list[int]) -> RequestOutput:
        n_new = min(len(new), len(req.output_ids))
        return RequestOutput(
            rid=req.rid, prompt_ids=req.prompt_ids, output_ids=list(req.output_ids),
            text=self.text_of(req) if req.finished else self.visible_text(req),
            finished=req.finished, finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            new_ids=req.output_ids[len(req.output_ids) - n_new:] if n_new else [],
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            arrival=req.arrival, token_times=list(req.token_times),
            spec=req.spec.as_dict() | {"cached_tokens": req.cached_tokens, "capture_fallback": req.capture_fallback})
