"""What the sweep's client can absorb: streamed chunks/s and tokens/s of the `openai` adapter at c1..c256
against a fast fake server (harness/fake_endpoint.py in its own process), beside a raw asyncio client
reading the same server, and the client's CPU per chunk.

For each level C: C requests in flight (closed loop), `--requests` = max(2 C, --min-requests) requests of
--max-tokens tokens streamed --tokens-per-chunk per SSE event, as fast as the server writes them.
  adapter: OpenAIAdapter.generate (what `specbench sweep` runs: SSE parsing, per-chunk timing, token
           counting, GenResult), dialect probing off;
  raw:     one keep-alive HTTP/1.1 connection per in-flight request on asyncio streams, chunked SSE split on
           b"\\n\\n", each event timed and json-decoded, nothing else: the ceiling of a Python asyncio client;
  sharded: the adapter behind --client-procs 2 (harness/adapters/sharded.py; CPU counts both workers'
           event loops; the processes are started once, before the first level, and not measured).
Columns: chunks/s and tokens/s over the level's wall time, CPU us per chunk (the client process's own CPU
time / chunks; the server runs in another process) and client CPU busy (process CPU / wall: near 100 %
means the client, not the server, set the rate). On a shared machine the server and the client compete
for cores, so compare the two clients within one run.

Usage: python -m specbench.benchmarks.client [--levels 1,4,16,64,256] [--max-tokens 256]
       [--tokens-per-chunk 1] [--min-requests 16] [--clients adapter,raw[,sharded]]
Prints a table, then one JSON document as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from specbench.harness.benchdoc import emit_document


def start_server(tokens_per_chunk: int, max_tokens: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "specbench.harness.fake_endpoint", "--port", "0",
                             "--tokens-per-chunk", str(tokens_per_chunk), "--max-tokens", str(max_tokens)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"the fake endpoint did not start: {line!r}")
    return proc, line.split()[-1]


async def _raw_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes, host: str) -> int:
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (host.encode(), len(body), body))
    await reader.readuntil(b"\r\n\r\n")
    chunks, buf = 0, b""
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return chunks
        buf += data[:-2]
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            payload = ev[6:]
            if payload != b"[DONE]":
                _ = time.perf_counter()
                obj = json.loads(payload)
                if obj.get("choices"):
                    chunks += 1


async def raw_client(url: str, conc: int, n: int, max_tokens: int) -> tuple[int, int]:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "fake-model", "prompt": "hello", "max_tokens": max_tokens, "stream": True}).encode()
    left = [n]

    async def worker() -> int:
        reader, writer = await asyncio.open_connection(host, int(port))
        got = 0
        while left[0] > 0:
            left[0] -= 1
            got += await _raw_one(reader, writer, body, f"{host}:{port}")
        writer.close()
        return got

    counts = await asyncio.gather(*(worker() for _ in range(conc)))
    return sum(counts), n * max_tokens


async def adapter_client(url: str, conc: int, n: int, max_tokens: int) -> tuple[int, int]:
    from specbench.harness.adapters.base import GenRequest
    from specbench.harness.adapters.openai_api import OpenAIAdapter

    ad = OpenAIAdapter(url, model="fake-model", probe=False, retries=0)
    reqs = [GenRequest(prompt="hello", max_tokens=max_tokens) for _ in range(n)]
    res = await ad.generate(reqs, concurrency=conc)
    await ad.aclose()
    bad = [r.error for r in res if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    return sum(len(r.chunk_times) for r in res), sum(r.completion_tokens or 0 for r in res)


async def sharded_client(url: str, conc: int, n: int, max_tokens: int, procs: int = 2) -> tuple[int, int]:
    """The adapter behind --client-procs (harness/adapters/sharded.py): `procs` client processes."""
    from specbench.harness.adapters.base import GenRequest
    from specbench.harness.adapters.openai_api import OpenAIAdapter
    from specbench.harness.adapters.sharded import ShardedAdapter

    if url not in SHARDED:  # the workers are started once per benchmark run (their start-up is not measured)
        engine = f"openai:{url},model=fake-model,probe=0,retries=0"
        SHARDED[url] = ShardedAdapter(OpenAIAdapter(url, model="fake-model", probe=False, retries=0), engine, procs)
    ad = SHARDED[url]
    res = await ad.generate([GenRequest(prompt="hello", max_tokens=max_tokens) for _ in range(n)], concurrency=conc)
    bad = [r.error for r in res if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    SHARD_CPU[:] = ad.client_cpu_by_proc
    return sum(len(r.chunk_times) for r in res), sum(r.completion_tokens or 0 for r in res)


SHARD_CPU: list[float] = []  # the worker processes' loop CPU of the last sharded measurement
SHARDED: dict[str, Any] = {}  # url -> the ShardedAdapter kept across levels
CLIENTS = {"adapter": adapter_client, "raw": raw_client, "sharded": sharded_client}


def measure(kind: str, url: str, conc: int, n: int, max_tokens: int) -> dict[str, Any]:
    cpu0, t0 = time.process_time(), time.perf_counter()
    SHARD_CPU.clear()
    chunks, tokens = asyncio.run(CLIENTS[kind](url, conc, n, max_tokens))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0 + sum(SHARD_CPU)
    return {"client": kind, "concurrency": conc, "requests": n, "chunks": chunks, "tokens": tokens, "wall_s": wall,
            "cpu_s": cpu, "chunks_s": chunks / wall, "tokens_s": tokens / wall, "cpu_us_per_chunk": cpu / chunks * 1e6,
            "client_busy": cpu / wall}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--levels", default="1,4,16,64,256")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--min-requests", type=int, default=16)
    ap.add_argument("--clients", default="adapter,raw")
    ap.add_argument("--out", default=None, help="Also write the JSON document here.")
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.levels.split(",")]
    kinds = [k.strip() for k in a.clients.split(",")]
    for k in kinds:
        if k not in CLIENTS:
            ap.error(f"--clients {k!r} is invalid: expected adapter, raw or sharded")
    proc, url = start_server(a.tokens_per_chunk, a.max_tokens)
    rows = []
    try:
        for k in kinds:  # warm: imports, connections, client processes, the server's first requests
            measure(k, url, 4, 8, a.max_tokens)
        print(f"{'client':<8} {'C':>4} {'requests':>8} {'chunks/s':>10} {'tokens/s':>10} {'CPU us/chunk':>12} "
              f"{'client busy':>11}")
        for c in levels:
            for k in kinds:
                r = measure(k, url, c, max(2 * c, a.min_requests), a.max_tokens)
                rows.append(r)
                print(f"{k:<8} {c:>4} {r['requests']:>8} {r['chunks_s']:>10.0f} {r['tokens_s']:>10.0f} "
                      f"{r['cpu_us_per_chunk']:>12.1f} {r['client_busy'] * 100:>10.0f}%", flush=True)
    finally:
        for ad in SHARDED.values():
            ad.close()
        SHARDED.clear()
        proc.terminate()
        proc.wait(10)
    doc = {"benchmark": "client", "max_tokens": a.max_tokens, "tokens_per_chunk": a.tokens_per_chunk, "rows": rows}
    emit_document(doc, a.out)
    return doc


if __name__ == "__main__":
    main()
