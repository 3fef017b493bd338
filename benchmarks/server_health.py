"""/health latency of a running `specbench serve` while one slow request is in flight (#23).

Starts `specbench serve` (the bundled tiny target, spec off, no warm-up) as users run it, in a subprocess
(`--server-path DIR`: from that checkout, e.g. a `git worktree` of an older commit, to measure the old server),
then for each case sends one request and polls GET /health every 5 ms on its own connection until the
request is answered, and reports the slowest /health answer and the median, and the slowest less the time the
poller and the server waited for a CPU (`own`: `waited`, the rule tests/test_server_fuzz.py asserts on). Cases:
- `tokenize-500k`: a 500,000-character prompt (~200k tokens, past the context: tokenized, then refused);
- `tokenize-8m`: an 8,000,000-character prompt (what the issue saw stall /health for 8.8 s);
- `prefill-2k`: a prompt at the usable context (one long prefill step holds the engine's lock);
- `idle`: no request, 100 polls;
- `stops-250k` / `stops-250k-128` / `stops-100k` / `stops-1k`: a streamed completion of 32 (128) tokens with that
  many stop strings of 10 characters that never match (250k: a 3.3 MB body); `stop-1mb`: one stop string of
  1,000,000 characters (issue 45); `stops-64x256`: 128 streamed tokens under 64 stops of 256 characters (the
  default limits), each starting with a space, so the text's end often looks like a stop's beginning;
- `chat-big` / `chat-spin` / `chat-wide` / `chat-double` / `chat-flood` (with `--template trap`): a chat request
  whose message makes the chat template do what `TRAPS` says (build 'x' * 10**9, run a nested loop of 10**10
  steps, ...); a plain chat request renders normally.
Each case also sends one small completion (4 tokens) 0.5 s after the case's request and reports how long it took
(`side s`; `side_during`: the case's request was still in flight when it left). `--template big|spin|trap` serves a copy of the bundled target whose chat template is one of
`TEMPLATES` and reports the start-up (launch -> /health 200, or the refusal and its exit code).

    python -m specbench.benchmarks.server_health [--cases idle,tokenize-500k,...] [--server-path DIR]
        [--serve-arg=--no-prefix-cache ...] [--template trap] [--request-timeout 600]

Prints a table, then one JSON document as the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

CASES = ("idle", "tokenize-500k", "tokenize-8m", "prefill-2k", "ids-1m", "stops-250k", "stops-250k-128", "stops-100k",
         "stops-1k", "stop-1mb", "stops-64x256")
_PLAIN = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
_SPIN = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
TRAPS = {  # what the trap template does when the last message's content is the key
    "big": "{{ 'x' * 10**9 }}",  # a gigabyte in one operation
    "spin": _SPIN,  # 10**10 empty loop steps: hours
    "wide": "{{ 'x'|center(10**9) }}",  # a gigabyte from a filter
    "double": "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "flood": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
    "refuse": "{{ raise_exception('the trap refuses this conversation') }}",
}
TEMPLATES = {  # trips at start-up (big, spin), or only on the message that asks for it (trap)
    "big": TRAPS["big"] + _PLAIN,
    "spin": TRAPS["spin"] + _PLAIN,
    "trap": "".join(f"{{% if messages[-1]['content'] == '{k}' %}}{v}{{% endif %}}" for k, v in TRAPS.items()) + _PLAIN,
}


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
    if case.startswith("stop"):
        n, tokens = {"stops-250k": (250_000, 32), "stops-250k-128": (250_000, 128), "stops-100k": (100_000, 32),
                     "stops-1k": (1_000, 32), "stop-1mb": (1, 32), "stops-64x256": (64, 128)}[case]
        stop = ["q" * 1_000_000] if case == "stop-1mb" else [f"nv{i:06d}zz" for i in range(n)]
        if case == "stops-64x256":  # at the limits: 64 stops of 256 characters, each starting like the text may
            stop = [" " + f"{i:03d}" * 85 for i in range(64)]
        return {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
                "stream": True, "stop": stop}
    if case.startswith("chat-"):
        return {"messages": [{"role": "user", "content": case[5:]}], "max_tokens": 4}
    return {"prompt": [7 + i % 200 for i in range(2040)], "max_tokens": 1, "temperature": 0}


def queued(server_pid: int) -> dict[str, int]:
    """Nanoseconds the calling thread and each thread of the server have sat runnable on a CPU queue so far
    (/proc/.../schedstat run_delay)."""
    with open("/proc/thread-self/schedstat") as f:
        out = {"self": int(f.read().split()[1])}
    for t in os.listdir(f"/proc/{server_pid}/task"):
        try:
            with open(f"/proc/{server_pid}/task/{t}/schedstat") as f:
                out[t] = int(f.read().split()[1])
        except (OSError, IndexError):
            pass
    return out


def waited(q0: dict[str, int], q1: dict[str, int]) -> float:
    """Seconds between two `queued` readings that the calling thread, then the server's longest-queued thread,
    waited for a CPU: what a poll's time owes to other processes on a loaded machine, not to the server. (The
    longest, not the sum: threads queued at once are not counted twice.)"""
    d = {k: v - q0.get(k, 0) for k, v in q1.items()}
    return (d.pop("self") + max(d.values(), default=0)) / 1e9


def measure(url: str, case: str, timeout: float = 600.0, server_pid: int | None = None) -> dict:
    body = _body(case)
    # serialized before the clock starts: httpx's own json= would hold this process's GIL against the poller
    data = json.dumps(body).encode() if body is not None else b""
    route = "/v1/chat/completions" if case.startswith("chat-") else "/v1/completions"
    lat: list[float] = []
    own: list[float] = []  # each poll less the CPU queueing (`waited`)
    status: dict = {}
    done = threading.Event()

    def send() -> None:
        t = time.perf_counter()
        try:
            r = httpx.post(url + route, content=data, headers={"content-type": "application/json"}, timeout=timeout)
            status["code"] = r.status_code
        except httpx.HTTPError as e:
            status["code"] = type(e).__name__
        finally:
            status["s"] = time.perf_counter() - t
            done.set()

    def side() -> None:  # a small completion sent meanwhile: does anyone else get served?
        t = time.perf_counter()
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": "1 2 3", "max_tokens": 4}, timeout=timeout)
            status["side_code"] = r.status_code
        except httpx.HTTPError as e:
            status["side_code"] = type(e).__name__
        status["side_s"] = time.perf_counter() - t

    t0 = time.perf_counter()
    sider = None
    if body is not None:
        threading.Thread(target=send, daemon=True).start()
        time.sleep(0.005)  # the request is on its way (polls start while it is received and prepared)

        def side_late() -> None:
            status["side_during"] = not done.is_set()
            side()

        # the small completion goes 0.5 s later, when a slow request is well into its work
        sider = threading.Timer(0.5, side_late)
        sider.daemon = True
        sider.start()
    # a fresh connection per case, its first answer timed too (accepting it needs the event loop as well)
    with httpx.Client(timeout=600) as c:
        while (not done.is_set()) if body is not None else len(lat) < 100:
            q0 = queued(server_pid) if server_pid else None
            t = time.perf_counter()
            try:
                c.get(url + "/health", timeout=timeout)
            except httpx.HTTPError:
                pass  # a timed-out poll counts at its full wait
            lat.append(time.perf_counter() - t)
            if q0 is not None and server_pid:
                own.append(max(0.0, lat[-1] - waited(q0, queued(server_pid))))
            time.sleep(0.005)
    if sider is not None:
        sider.join(timeout)
    return {"case": case, "request_s": round(status.get("s", time.perf_counter() - t0), 3),
            "answer": status.get("code"), "polls": len(lat),
            "health_max_ms": round(max(lat) * 1000, 1) if lat else None,
            "health_p50_ms": round(statistics.median(lat) * 1000, 2) if lat else None,
            "health_own_max_ms": round(max(own) * 1000, 1) if own else None,
            "side_s": round(status["side_s"], 3) if "side_s" in status else None, "side": status.get("side_code"),
            "side_during": status.get("side_during")}


def template_model(name: str, into: Path) -> Path:
    """A copy of the bundled target (its files linked) whose chat template is `TEMPLATES[name]`."""
    from specbench.harness.fixtures import bundled_pair

    src = Path(bundled_pair()[0])
    for f in src.iterdir():
        if f.name != "tokenizer_config.json":
            (into / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATES[name]
    (into / "tokenizer_config.json").write_text(json.dumps(cfg))
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--server-path", default=None, help="run the server from this checkout (PYTHONPATH)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `specbench serve` argument")
    ap.add_argument("--template", choices=sorted(TEMPLATES), default=None,
                    help="serve the bundled target with this chat template (TEMPLATES)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request or a poll may take")
    args = ap.parse_args()

    env = dict(os.environ, **({"PYTHONPATH": args.server_path} if args.server_path else {}))
    port = _free_port()
    tmp = tempfile.TemporaryDirectory(prefix="server_health-")
    model = ["--model", str(template_model(args.template, Path(tmp.name)))] if args.template else []
    cmd = [sys.executable, "-m", "specbench", "serve", "--spec", "off", "--no-warmup", "--port", str(port),
           "--num-pages", "512", "--log-level", "warning", *model, *args.serve_arg]
    t_launch = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    start: dict = {}
    rows: list[dict] = []
    try:
        for _ in range(6000):
            if p.poll() is not None:
                start = {"refused": (p.stderr.read() if p.stderr else "").strip().splitlines()[-1:],
                         "exit": p.returncode}
                break
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        start["seconds"] = round(time.perf_counter() - t_launch, 2)
        if "exit" not in start:
            rows = [measure(url, c, args.request_timeout, p.pid) for c in args.cases.split(",")]
    finally:
        p.terminate()
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            start["sigterm"] = "ignored for 30 s: killed"
            p.kill()
            p.wait(30)
        tmp.cleanup()
    print(f"start-up: {start}")
    print(f"{'case':<16}{'request s':>10}{'answer':>8}{'polls':>7}{'/health max ms':>16}{'p50 ms':>8}"
          f"{'own max ms':>12}{'side s':>8}")
    for r in rows:
        print(f"{r['case']:<16}{r['request_s']:>10}{r['answer']!s:>8}{r['polls']:>7}{r['health_max_ms']!s:>16}"
              f"{r['health_p50_ms']!s:>8}{r['health_own_max_ms']!s:>12}{r['side_s']!s:>8}")
    from specbench.harness.benchdoc import emit_document

    emit_document({"benchmark": "server_health", "server_path": args.server_path, "serve_args": args.serve_arg,
                   "template": args.template, "start": start, "rows": rows})


if __name__ == "__main__":
    main()
