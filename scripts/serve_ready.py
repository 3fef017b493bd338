#!/usr/bin/env python3
"""Time `specbench serve` from launch to ready (#28 item 5): run by `scripts/gpu.sh serve-ready`.

Launches `specbench serve ARGS...` (its own process session), polls GET /health every 0.2 s and records:
  t_answer_s       launch -> the first HTTP answer (503 "starting" while the warm-up runs)
  t_ready_s        launch -> /health 200 (ready: the warm-up is done)
  warmup           the warm-up record /health reports (seconds, phases, graphs captured, cache dirs)
  first_completion_s   one 16-token greedy completion right after ready (the request that took 88 s before)
  burst8_s / burst64_s 8 / 64 concurrent 16-token completions after that (new batch buckets: no capture, no JIT)
then stops the server (SIGTERM to its session) and prints one JSON line, also appended to --out.
The caller picks the caches with the environment (FLASHINFER_WORKSPACE_BASE, TRITON_CACHE_DIR).
Stdlib only (urllib, through `specbench.harness.http_json`), so it runs under any interpreter that has the
project installed (gpu.sh installs it).

Usage: serve_ready.py --label NAME --port P --timeout S --out FILE -- specbench-serve-args...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from specbench.harness.http_json import http


def completion(root: str, timeout: float) -> tuple[float, int]:
    t = time.perf_counter()
    code, _ = http(root + "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 16,
                                              "temperature": 0, "ignore_eos": True}, timeout=timeout)
    return round(time.perf_counter() - t, 3), code


def burst(root: str, n: int, timeout: float) -> tuple[float, list[int]]:
    codes: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        _, c = completion(root, timeout)
        with lock:
            codes.append(c)

    t = time.perf_counter()
    ths = [threading.Thread(target=one) for _ in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(timeout)
    return round(time.perf_counter() - t, 3), sorted(set(codes))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True)
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--timeout", type=float, default=200.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--log", default=None)
    ap.add_argument("serve", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    args = [x for x in a.serve if x != "--"]
    root = f"http://127.0.0.1:{a.port}"
    argv = [sys.executable, "-m", "specbench", "serve", "--port", str(a.port), *args]
    rec: dict = {"label": a.label, "argv": argv[1:], "env": {k: os.environ.get(k) for k in
                                                           ("FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR")}}
    fh = open(a.log, "wb") if a.log else subprocess.DEVNULL
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    end = t0 + a.timeout
    try:
        while time.perf_counter() < end:
            if p.poll() is not None:
                rec["exited"] = p.returncode
                break
            code, body = http(root + "/health", timeout=2.0)
            now = round(time.perf_counter() - t0, 2)
            if code and "t_answer_s" not in rec:
                rec["t_answer_s"], rec["first_answer"] = now, code
            if code == 200:
                rec["t_ready_s"] = now
                try:
                    rec["warmup"] = json.loads(body).get("warmup")
                except ValueError:
                    rec["warmup"] = body[:500]
                break
            if code == 503:
                try:
                    rec["last_starting"] = json.loads(body).get("warmup")
                except ValueError:
                    pass
            time.sleep(0.2)
        if "t_ready_s" in rec:
            left = max(5.0, end - time.perf_counter())
            rec["first_completion_s"], rec["first_completion_status"] = completion(root, left)
            rec["second_completion_s"], _ = completion(root, left)
            rec["burst8_s"], rec["burst8_status"] = burst(root, 8, max(5.0, end - time.perf_counter()))
            rec["burst64_s"], rec["burst64_status"] = burst(root, 64, max(5.0, end - time.perf_counter()))
        else:
            rec.setdefault("timed_out_s", a.timeout)
    finally:
        rec["total_s"] = round(time.perf_counter() - t0, 2)
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(15)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
        line = json.dumps(rec)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as fo:
                fo.write(line + "\n")
        if a.log:
            Path(a.log).with_suffix(".tail").write_text(
                "\n".join(Path(a.log).read_text(errors="replace").splitlines()[-40:]))
    return 0 if "t_ready_s" in rec else 1


if __name__ == "__main__":
    raise SystemExit(main())
