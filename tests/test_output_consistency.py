"""Output consistency in every greedy gate run, for any engine: a result's usage, streamed chunks, max_tokens and
finish reason agree with its own ids (`check_counts`), and where the candidate's ids equal the baseline's whole
output (same engine kind), text and finish reason are equal too (`same_tokens_differ`): the detokenizer and
stop-bookkeeping bugs that leave the token ids right. Each rule: PASS clean, FAIL on a constructed bad engine."""

from __future__ import annotations

import asyncio
import dataclasses

from lossless_fakes import FakeAdapter

from specbench.harness.adapters.base import GenResult
from specbench.suites.lossless.checks import check_counts, count_problems, same_tokens_differ
from specbench.suites.lossless.greedy import GreedyGateOptions, Prompt, run_greedy, same_engine_kind

PROMPTS = [Prompt(f"p{i}", [5 + i, 6, 7 + i]) for i in range(4)]
T = 10


def text_of(ids: list[int]) -> str:
    return " ".join(f"t{t}" for t in ids)


class Texted(FakeAdapter):
    """The fake engine with text: decode(ids), streamed as one chunk per token."""

    def __init__(self, *a, corrupt=None, **kw) -> None:
        super().__init__(*a, **kw)
        self.corrupt = corrupt  # GenResult -> GenResult: the bug

    async def generate_one(self, req):
        r = await super().generate_one(req)
        r = dataclasses.replace(r, text=text_of(r.output_ids), chunk_tokens=[1] * len(r.output_ids),
                                token_count_method="engine")
        return self.corrupt(r) if self.corrupt else r


def gate(cand: FakeAdapter, base: FakeAdapter | None = None):
    return asyncio.run(run_greedy(base or Texted(), cand, PROMPTS, T, GreedyGateOptions(), concurrency=2))


def counts_check(run):
    return next(c for c in run.checks if c.name == "output-counts")


def test_clean_engine_passes_every_consistency_rule():
    run = gate(Texted())
    assert all(p.status == "identical" for p in run.prompts)
    ck = counts_check(run)
    assert ck.ok and not ck.skipped and "4 outputs" in ck.detail


def test_same_ids_different_text_fails():
    """A streaming detokenizer that drops a multi-token step's last piece: ids right, text wrong."""
    def drop(r: GenResult) -> GenResult:
        return dataclasses.replace(r, text=r.text.rsplit(" ", 1)[0])
    run = gate(Texted(corrupt=drop))
    assert all(p.status == "fail" and "same tokens, different text" in p.reason for p in run.prompts)


def test_same_ids_different_finish_reason_fails():
    def stop(r: GenResult) -> GenResult:
        return dataclasses.replace(r, finish_reason="stop")
    run = gate(Texted(corrupt=stop))
    assert all(p.status == "fail" and "finish_reason 'stop'" in p.reason for p in run.prompts)


def test_text_is_compared_only_between_engines_of_one_kind():
    class Other(Texted):
        kind = "other"
    assert same_engine_kind(Texted(), Texted()) and not same_engine_kind(Texted(), Other())
    run = gate(Other(corrupt=lambda r: dataclasses.replace(r, text=r.text.upper())))
    assert all(p.status == "identical" for p in run.prompts)


def test_usage_chunks_and_length_that_disagree_with_the_ids_fail():
    def usage(r: GenResult) -> GenResult:  # usage counts a rejected draft token
        return dataclasses.replace(r, completion_tokens=len(r.output_ids) + 1)
    ck = counts_check(gate(Texted(corrupt=usage)))
    assert not ck.ok and "usage completion_tokens 11 != 10" in ck.detail

    def chunks(r: GenResult) -> GenResult:  # a streamed chunk carried a token the final answer does not have
        return dataclasses.replace(r, chunk_tokens=[2] + r.chunk_tokens[1:])
    ck = counts_check(gate(Texted(corrupt=chunks)))
    assert not ck.ok and "streamed chunks carried 11 tokens, 10 returned" in ck.detail

    def overrun(r: GenResult) -> GenResult:  # the bonus token appended past max_tokens
        ids = r.output_ids + [1]
        return dataclasses.replace(r, output_ids=ids, completion_tokens=len(ids), chunk_tokens=[1] * len(ids))
    ck = counts_check(gate(Texted(corrupt=overrun)))
    assert not ck.ok and "11 tokens returned for max_tokens=10" in ck.detail


def test_finish_length_before_max_tokens_fails():
    r = GenResult("r", True, output_ids=[1, 2, 3], finish_reason="length", completion_tokens=3)
    assert count_problems(r, 5) == ["finish_reason 'length' after 3 of max_tokens=5 tokens"]
    assert count_problems(r, 3) == [] and count_problems(r) == []


def test_inexact_chunk_counts_and_missing_ids_are_not_judged():
    r = GenResult("r", True, output_ids=[1, 2], chunk_tokens=[1, 1, 1], token_count_method="text")
    assert count_problems(r, 2) == []
    assert check_counts([GenResult("x", True, output_ids=None)]).skipped
    assert check_counts([GenResult("x", False, error="boom")]).skipped


def test_same_tokens_differ_names_the_first_difference():
    a = GenResult("a", True, text="hello world", output_ids=[1], finish_reason="length")
    b = GenResult("b", True, text="hello there", output_ids=[1], finish_reason="length")
    assert "from character 6" in same_tokens_differ(a, b)
    assert same_tokens_differ(a, a) is None
    assert same_tokens_differ(a, dataclasses.replace(a, text="")) is None  # an arm without text: not judged
