"""Sweep metric arithmetic on synthetic timelines: no engine, known answers."""

from __future__ import annotations

import pytest

from specbench.harness.adapters.base import GenResult
from specbench.suites.sweep.compare import noise_floor, paired_ratios, resolved, speedup
from specbench.suites.sweep.metrics import (
    acceptance,
    cell_stats,
    derive,
    reconcile_chunks,
    request_record,
    summary,
)


def rec(chunks: list[tuple[float, int]], n: int | None, ok: bool = True, spec: dict | None = None,
        t_send: float = 0.0) -> dict:
    """A request record (stored shape) whose chunks arrive at (seconds after send, tokens)."""
    return {"ok": ok, "completion_tokens": n, "prompt_tokens": 10, "wall_send": t_send,
            "ttft": chunks[0][0] if chunks else None, "e2el": chunks[-1][0] if chunks else None,
            "chunk_offsets": [t for t, _ in chunks], "chunk_tokens": [c for _, c in chunks], "spec": spec}


def test_multi_token_chunks() -> None:
    # chunks: t=0.1 1 token (first), t=0.3 3 tokens, t=0.4 2 tokens -> 6 tokens
    d = derive(rec([(0.1, 1), (0.3, 3), (0.4, 2)], 6))
    assert d["output_tokens"] == 6
    assert d["ttft"] == pytest.approx(0.1)
    assert d["e2el"] == pytest.approx(0.4)
    assert d["tpot"] == pytest.approx(0.3 / 5)
    assert d["itls"] == pytest.approx([0.2 / 3] * 3 + [0.05] * 2)
    assert d["chunk_gaps"] == pytest.approx([0.2, 0.1])
    # per-token ITL sums to the decode time; raw gaps are ~acceptance-length larger than per-token ITL
    assert sum(d["itls"]) == pytest.approx(d["e2el"] - d["ttft"])


def test_first_chunk_with_several_tokens() -> None:
    d = derive(rec([(0.2, 4), (0.5, 4)], 8))
    assert d["ttft"] == pytest.approx(0.2)
    assert d["tpot"] == pytest.approx(0.3 / 7)
    assert len(d["itls"]) == 4  # the first chunk's tokens have no inter-token gap


def test_single_token_output() -> None:
    d = derive(rec([(0.25, 1)], 1))
    assert d["ttft"] == pytest.approx(0.25) and d["e2el"] == pytest.approx(0.25)
    assert d["tpot"] is None and d["itls"] == [] and d["chunk_gaps"] == []
    s = cell_stats([rec([(0.25, 1)], 1)], duration=0.5)
    assert s["tpot"]["n"] == 0 and s["tpot"]["mean"] is None
    assert s["output_tok_s"] == pytest.approx(2.0)


def test_eos_inside_a_chunk_drops_tokens_after_it() -> None:
    # the engine streamed 4 tokens in the last chunk and 2 more after, but usage says 5 (EOS is token 5)
    r = rec([(0.1, 1), (0.3, 4), (0.4, 2)], 5)
    assert reconcile_chunks(r["chunk_tokens"], 5) == [1, 4, 0]
    d = derive(r)
    assert d["output_tokens"] == 5
    assert d["e2el"] == pytest.approx(0.3)  # ends at the chunk that carried the last counted token
    assert d["tpot"] == pytest.approx(0.2 / 4)
    assert d["itls"] == pytest.approx([0.05] * 4)
    assert d["chunk_gaps"] == pytest.approx([0.2])


def test_usage_shortfall_is_booked_to_the_last_chunk() -> None:
    assert reconcile_chunks([1, 1, 1], 5) == [1, 1, 3]
    assert reconcile_chunks([2, 2], None) == [2, 2]


def test_failed_requests_count_only_as_failed() -> None:
    good = rec([(0.1, 1), (0.2, 1)], 2)
    bad = {"ok": False, "error": "boom", "completion_tokens": None, "wall_send": 0.0, "e2el": 0.05,
           "chunk_offsets": [], "chunk_tokens": [], "spec": None}
    partial = rec([(0.1, 1), (0.2, 1), (0.3, 1)], 3, ok=False)  # died mid-stream
    s = cell_stats([good, bad, partial], duration=1.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 1, 2)
    assert s["output_tokens"] == 2 and s["output_tok_s"] == pytest.approx(2.0)
    assert s["req_s"] == pytest.approx(1.0)
    assert s["ttft"]["n"] == 1 and s["e2el"]["mean"] == pytest.approx(0.2)


def test_no_chunks_uses_response_times() -> None:
    r = {"ok": True, "completion_tokens": 4, "wall_send": 1.0, "ttft": None, "e2el": 0.8,
         "chunk_offsets": [], "chunk_tokens": []}
    d = derive(r)
    assert d["e2el"] == pytest.approx(0.8) and d["ttft"] == pytest.approx(0.8) and d["tpot"] == 0.0


def test_duration_from_records_when_not_given() -> None:
    s = cell_stats([rec([(0.1, 1), (0.5, 1)], 2, t_send=1.0), rec([(0.1, 2)], 2, t_send=1.2)])
    assert s["duration"] == pytest.approx(0.5)
    assert s["output_tok_s"] == pytest.approx(8.0)


def test_summary_percentiles() -> None:
    s = summary([float(i) for i in range(1, 101)] + [None])
    assert s["n"] == 100 and s["mean"] == pytest.approx(50.5) and s["median"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert summary([])["mean"] is None


def spec(drafts: int, k: int, runs: list[int]) -> dict:
    per_pos = [sum(1 for m in runs if m > i) for i in range(k)]
    return {"num_drafts": drafts, "num_draft_tokens": drafts * k, "num_accepted_tokens": sum(runs),
            "accepted_per_pos": per_pos}


def test_acceptance_request_mean_vs_token_weighted() -> None:
    # request 1: 2 verify steps accepting 3 and 3 (length 4); request 2: 4 steps accepting 0 (length 1)
    a = rec([(0.1, 4), (0.2, 4)], 8, spec=spec(2, 4, [3, 3]))
    b = rec([(0.1, 1), (0.2, 1), (0.3, 1), (0.4, 1)], 4, spec=spec(4, 4, [0, 0, 0, 0]))
    acc = acceptance([a, b])
    assert acc["source"] == "request"
    assert acc["length"] == pytest.approx(1 + 6 / 6)  # pooled: 12 committed tokens over 6 steps
    assert acc["length_request_mean"] == pytest.approx((4.0 + 1.0) / 2)
    assert acc["rate"] == pytest.approx(6 / 24)
    assert acc["rate_request_mean"] == pytest.approx((6 / 8 + 0) / 2)
    assert acc["per_pos"] == pytest.approx([2 / 6, 2 / 6, 2 / 6, 0.0])
    assert sum(acc["accepted_per_pos"]) == acc["num_accepted_tokens"]


def test_acceptance_falls_back_to_counters_and_labels_it() -> None:
    a = rec([(0.1, 2)], 2)  # no per-request spec
    counters = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 15,
                "accepted_per_pos": [8, 5, 2, 0], "source": "prometheus"}
    acc = acceptance([a], counters)
    assert acc["source"] == "counters" and acc["length"] == pytest.approx(2.5)
    assert acc["length_request_mean"] is None and acc["per_pos"] == pytest.approx([0.8, 0.5, 0.2, 0.0])
    assert acceptance([a], None) is None
    off = rec([(0.1, 2)], 2, spec={"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0})
    assert acceptance([off]) is None  # spec off: no drafts, no acceptance


def test_request_record_from_genresult() -> None:
    r = GenResult(rid="x", ok=True, t_send=10.0, t_first=10.2, t_end=10.5, completion_tokens=5, prompt_tokens=3,
                  chunk_times=[10.2, 10.4, 10.5], chunk_tokens=[1, 3, 1],
                  spec={"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 2, "accepted_runs": [2, 0],
                        "accepted_per_pos": [1, 1, 0, 0], "mean_accept_len": 2.0})
    d = request_record(r)
    assert d["chunk_offsets"] == pytest.approx([0.2, 0.4, 0.5])
    assert acceptance([d])["num_drafts"] == 2
    m = derive(d)
    assert m["ttft"] == pytest.approx(r.ttft) and m["tpot"] == pytest.approx(r.tpot)
    assert m["itls"] == pytest.approx(r.token_itls())


def test_speedup_is_the_median_paired_ratio() -> None:
    a = {0: 100.0, 1: 110.0, 2: 90.0}
    b = {0: 150.0, 1: 154.0, 2: 144.0}
    assert paired_ratios(a, b) == pytest.approx([1.5, 1.4, 1.6])
    sp = speedup(a, b)
    assert sp["median"] == pytest.approx(1.5) and sp["min"] == pytest.approx(1.4) and sp["rounds"] == 3


def test_noise_floor_pairs_rounds_and_skips_missing() -> None:
    a = {0: 100.0, 1: 100.0, 2: 100.0, 3: 100.0}
    a2 = {0: 101.0, 1: 97.0, 2: 102.0}  # round 3 interrupted
    nf = noise_floor(a, a2)
    assert nf["rounds"] == 3
    assert nf["median_ratio"] == pytest.approx(1.01)
    assert nf["noise"] == pytest.approx(0.02)  # median of |r-1| = (0.01, 0.03, 0.02)
    assert nf["max_dev"] == pytest.approx(0.03)
    assert resolved(speedup(a, {0: 101.5, 1: 101.5, 2: 101.5}), nf) is False
    assert resolved(speedup(a, {0: 150.0, 1: 150.0, 2: 150.0}), nf) is True
    assert noise_floor({0: 1.0}, {1: 1.0}) is None and resolved(None, nf) is None
