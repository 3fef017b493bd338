"""Per-step cost of a request's streamed text: incremental (engine/detok.py) vs decoding the whole output.

For each output length N, one request's output grows one token per step from 0 to N (ids of a real text,
repeated); each step asks the OutputWriter for the partial text, as `build()` does. Reported: microseconds
per step at the last 10% of the steps (the cost at length ~N) and over all N steps, median of --repeats
interleaved repeats, for `incremental=True` and `False`, and their ratio.

Usage: python -m specbench.benchmarks.detok [--lengths 128,2048] [--repeats 5] [--model DIR]
Prints a table, then one JSON document as the last line.
"""

from __future__ import annotations

import argparse
import statistics
import time

from specbench.harness.benchdoc import emit_document

TEXT = ("Speculative decoding drafts several tokens and verifies them in one pass of the target model; "
        "naïve café ☕ — 数学 12 + 30 = 42. ")


def one_run(writer, tok, ids: list[int]) -> tuple[float, float]:
    from specbench.engine.config import SamplingParams
    from specbench.engine.request import Request

    req = Request(rid="r", prompt_ids=[1], params=SamplingParams(max_tokens=len(ids)))
    per = []
    for t in ids:
        req.output_ids.append(t)
        s = time.perf_counter()
        writer.partial_text(req)
        per.append(time.perf_counter() - s)
    tail = per[-max(1, len(per) // 10):]
    return statistics.mean(tail) * 1e6, statistics.mean(per) * 1e6


def run(model: str | None, lengths: tuple[int, ...], repeats: int) -> dict:
    from specbench.engine.metrics import EngineMetrics
    from specbench.engine.output import OutputWriter
    from specbench.engine.tokenizer import Tokenizer
    from specbench.harness.fixtures import bundled_pair

    tok = Tokenizer(model or str(bundled_pair()[0]))
    base = tok.encode(TEXT)
    res: dict = {"model": tok.name, "repeats": repeats, "rows": []}
    for n in lengths:
        ids = (base * (n // len(base) + 1))[:n]
        got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(repeats):  # interleaved A/B
            for inc in (True, False):
                got[inc].append(one_run(OutputWriter(tok, set(), EngineMetrics(), incremental=inc), tok, ids))
        row: dict[str, float] = {"length": n}
        for inc, name in ((True, "incremental"), (False, "full")):
            row[f"{name}_us_at_length"] = statistics.median(x[0] for x in got[inc])
            row[f"{name}_us_mean"] = statistics.median(x[1] for x in got[inc])
        row["full_over_incremental_at_length"] = row["full_us_at_length"] / row["incremental_us_at_length"]
        res["rows"].append(row)
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m specbench.benchmarks.detok", description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="128,2048")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", help="a model directory with tokenizer.json (default: the bundled tiny target)")
    a = ap.parse_args(argv)
    try:
        lengths = tuple(int(x) for x in a.lengths.split(","))
    except ValueError:
        raise SystemExit(f"--lengths: expected comma-separated integers, got {a.lengths!r}") from None
    if a.repeats < 1 or any(n < 1 for n in lengths):
        raise SystemExit("--repeats and every --lengths entry must be >= 1")
    res = run(a.model, lengths, a.repeats)
    print("length | incremental us/step | full decode us/step | full / incremental")
    for r in res["rows"]:
        print(f"{r['length']:6d} | {r['incremental_us_at_length']:19.1f} | {r['full_us_at_length']:19.1f} | "
              f"{r['full_over_incremental_at_length']:.1f}x")
    emit_document(res)
    return res


if __name__ == "__main__":
    main()
