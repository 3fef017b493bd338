"""/health latency of a running `specbench serve` while one slow request is in flight (#23).

Starts `specbench serve` (the bundled tiny target, spec off, no warm-up) as users run it, in a subprocess
(`--server-path DIR`: from that checkout, e.g. a `git worktree` of an older commit, to measure the old server),
then for each case sends one request and polls GET /health every 5 ms on its own connection until the
request is answered, and reports the slowest /health answer and the median. Cases:
- `tokenize-500k`: a 500,000-character prompt (~200k tokens, past the context: tokenized, then refused);
- `tokenize-8m`: an 8,000,000-character prompt (what the issue saw stall /health for 8.8 s);
- `prefill-2k`: a prompt at the usable context (one long prefill step holds the engine's lock);
- `idle`: no request, 100 polls.

    python -m specbench.benchmarks.server_health [--cases idle,tokenize-500k,...] [--server-path DIR]
        [--serve-arg=--no-prefix-cache ...]

Prints a table, then one JSON document as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

CASES = ("idle", "tokenize-500k", "tokenize-8m", "prefill-2k", "ids-1m")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _body(case: str) -> dict | None:
    if case == "idle":
        return None
    if case.startswith("tokenize-"):
        n = 500_000 if case.endswith("500k") else 8_000_000
        words = "the quick brown fox jumps over the lazy dog 12345 "
        return {"prompt": (words * (n // len(words) + 1))[:n], "max_tokens": 1}
    if case == "ids-1m":  # a million six-digit token ids: the JSON parse alone would hold the GIL ~65 ms
        return {"prompt": [100_000 + i % 50_000 for i in range(1_000_000)], "max_tokens": 1}
    return {"prompt": [7 + i % 200 for i in range(2040)], "max_tokens": 1, "temperature": 0}


def measure(url: str, case: str) -> dict:
    body = _body(case)
    # serialized before the clock starts: httpx's own json= would hold this process's GIL against the poller
    data = json.dumps(body).encode() if body is not None else b""
    lat: list[float] = []
    status: dict = {}
    done = threading.Event()

    def send() -> None:
        try:
            r = httpx.post(url + "/v1/completions", content=data, headers={"content-type": "application/json"},
                           timeout=600)
            status["code"] = r.status_code
        except httpx.HTTPError as e:
            status["code"] = type(e).__name__
        finally:
            done.set()

    t0 = time.perf_counter()
    if body is not None:
        threading.Thread(target=send, daemon=True).start()
        time.sleep(0.005)  # the request is on its way (polls start while it is received and prepared)
    # a fresh connection per case, its first answer timed too (accepting it needs the event loop as well)
    with httpx.Client(timeout=600) as c:
        while (not done.is_set()) if body is not None else len(lat) < 100:
            t = time.perf_counter()
            c.get(url + "/health")
            lat.append(time.perf_counter() - t)
            time.sleep(0.005)
    return {"case": case, "request_s": round(time.perf_counter() - t0, 3), "answer": status.get("code"),
            "polls": len(lat), "health_max_ms": round(max(lat) * 1000, 1) if lat else None,
            "health_p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--server-path", default=None, help="run the server from this checkout (PYTHONPATH)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `specbench serve` argument")
    args = ap.parse_args()
    import os

    env = dict(os.environ, **({"PYTHONPATH": args.server_path} if args.server_path else {}))
    port = _free_port()
    cmd = [sys.executable, "-m", "specbench", "serve", "--spec", "off", "--no-warmup", "--port", str(port),
           "--num-pages", "512", "--log-level", "warning", *args.serve_arg]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        rows = [measure(url, c) for c in args.cases.split(",")]
    finally:
        p.terminate()
        p.wait(30)
    print(f"{'case':<16}{'request s':>10}{'answer':>8}{'polls':>7}{'/health max ms':>16}{'p50 ms':>8}")
    for r in rows:
        print(f"{r['case']:<16}{r['request_s']:>10}{r['answer']!s:>8}{r['polls']:>7}{r['health_max_ms']!s:>16}"
              f"{r['health_p50_ms']!s:>8}")
    from specbench.harness.benchdoc import emit_document

    emit_document({"benchmark": "server_health", "server_path": args.server_path, "serve_args": args.serve_arg,
                   "rows": rows})


if __name__ == "__main__":
    main()
