"""`specbench serve` start-up and shutdown as an operator sees them (#23): SIGTERM / SIGINT drain and exit
0 with one line, no traceback; start-up failures in one line with a documented exit code, before torch.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import held_engine
import httpx
import pytest

from specbench.engine import EngineConfig, LLMEngine, SpecConfig
from specbench.harness.server import ServerThread, make_app

# runs `specbench serve ARGS` in a fresh interpreter and reports whether torch got imported before it exited
PROBE = ("import sys; from specbench.cli import main; sys.argv = ['specbench', 'serve'] + sys.argv[1:]\n"
         "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
         "print('TORCH', 'torch' in sys.modules, file=sys.stderr); sys.exit(code)")


def _probe(*args: str) -> tuple[int, str, bool]:
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if not ln.startswith("TORCH")]
    return r.returncode, "\n".join(lines), "TORCH True" in r.stderr


def test_start_up_failures_are_one_line_before_torch(tmp_path):
    cases = []
    cases.append((["--model", str(tmp_path / "nope")], 2, "--model=", "no such directory"))
    (tmp_path / "file").write_text("x")
    cases.append((["--model", str(tmp_path / "file")], 2, "--model=", "not a directory"))
    bad = tmp_path / "badcfg"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    (bad / "tokenizer.json").write_text("{}")
    cases.append((["--model", str(bad)], 2, "config.json", "not valid JSON"))
    notok = tmp_path / "notok"
    notok.mkdir()
    (notok / "config.json").write_text("{}")
    cases.append((["--model", str(notok)], 2, "tokenizer.json", "missing"))
    cases.append((["--allowed-origins", "ftp://x"], 2, "--allowed-origins", "expected '*'"))
    cases.append((["--shutdown-timeout", "-1"], 2, "--shutdown-timeout", "0..3600"))
    cases.append((["--api-key", "a b"], 2, "--api-key", "without spaces"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases.append((["--model", str(notok), "--port", str(port)], 2, "tokenizer.json", "missing"))
        rc, err, torch = _probe("--model", str(bad.parent / "notok"), "--port", str(port))
        assert rc == 2  # the model is checked first
        with ThreadPoolExecutor(4) as ex:  # fresh interpreters: run a few at once
            results = list(ex.map(lambda c: _probe(*c[0]), cases))
        for (args, want_rc, field, what), (rc, err, torch) in zip(cases, results, strict=True):
            assert rc == want_rc, (args, err)
            assert len(err.splitlines()) == 1 and field in err and what in err, (args, err)
            assert not torch, args  # failed before the slow imports
        # a busy port: exit 3, one line naming the port and what to do, before the engine loads
        rc, err, torch = _probe("--port", str(port), "--no-warmup")
        assert rc == 3 and len(err.splitlines()) == 1, err
        assert f"--port={port} is busy" in err and "--port 0" in err


READY_LIMIT_S = 300.0  # hang guards only: each wait below ends on an event (ready, first token, exit)


def _start(tiny_pair, gate_dir: Path, mode: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`specbench serve` with its engine held after each request's first token (tests/held_engine.py): with
    `mode` "signal" the server opens the gate right after its signal handler ran, with "never" only the server's
    cancel (the grace period's end) ends the request. No request can end before the test wants it to."""
    args = ["--model", tiny_pair[0], "--spec", "off", "--port", "0", "--num-pages", "256", "--no-warmup",
            "--served-model-name", "cli", *extra]
    p = subprocess.Popen(held_engine.launch_cmd(gate_dir, mode, *args), stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    first = p.stderr.readline()
    m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", first)
    if m is None:
        p.kill()
        raise AssertionError(f"the server did not start: {first}{p.stderr.read()}")
    url = f"http://127.0.0.1:{m.group(1)}"
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < READY_LIMIT_S:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    p.kill()
    raise AssertionError(f"the server never became ready: {p.stderr.read()}")


def _stream(url: str, out: dict, first: threading.Event, max_tokens: int) -> None:
    body = {"model": "cli", "prompt": "1 2 3", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=READY_LIMIT_S) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    finally:
        out["events"] = events
        first.set()  # a stream that failed before its first event wakes the test too (it then finds no events)


def _shutdown(p: subprocess.Popen, sig: int, url: str, max_tokens: int) -> tuple[int, str, dict]:
    """Start a stream, send `sig` once its first event arrived (the engine holds the rest), wait for the exit."""
    out: dict = {}
    first = threading.Event()
    t = threading.Thread(target=_stream, args=(url, out, first, max_tokens))
    t.start()
    assert first.wait(READY_LIMIT_S) and "events" not in out, f"the stream never started: {out}"
    p.send_signal(sig)
    rc = p.wait(READY_LIMIT_S)
    t.join(READY_LIMIT_S)
    return rc, p.stderr.read(), out


def test_sigterm_past_the_grace_period_cancels_cleanly(tiny_pair, tmp_path):
    p, url = _start(tiny_pair, tmp_path, "never", "--shutdown-timeout", "0.3", "--log-level", "warning")
    try:
        rc, err, out = _shutdown(p, signal.SIGTERM, url, 60)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0, err
    assert "Traceback" not in err and err.strip().splitlines() == [err.strip()], err  # one line
    assert re.fullmatch(r"specbench serve: shut down on SIGTERM in \d+\.\d s: 0 in-flight requests finished, "
                        r"1 aborted \(--shutdown-timeout 0\.3 s\)", err.strip()), err
    ev = out["events"]
    assert ev[-1] == "[DONE]" and json.loads(ev[-2])["error"]["code"] == "shutting_down", ev[-3:]
    assert not (tmp_path / "open").exists()  # the request was held until the grace period ran out


def test_sigint_within_the_grace_period_finishes_the_request(tiny_pair, tmp_path):
    p, url = _start(tiny_pair, tmp_path, "signal", "--shutdown-timeout", "60", "--log-level", "warning")
    try:
        rc, err, out = _shutdown(p, signal.SIGINT, url, 60)
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "shut down on SIGINT" in err and "1 in-flight requests finished, 0 aborted" in err, err
    ev = out["events"]
    assert ev[-1] == "[DONE]" and all("error" not in json.loads(e) for e in ev[:-1])
    assert json.loads(ev[-2])["choices"][0]["finish_reason"] == "length"
    assert (tmp_path / "open").exists()  # the tokens after the first went out once the signal had landed


@pytest.fixture(scope="module")
def served(tiny_pair):
    target, draft = tiny_pair
    draft = draft if draft and Path(draft).is_dir() else None
    eng = LLMEngine(EngineConfig(model=target, draft=draft, spec=SpecConfig(method="dflash" if draft else "ngram"),
                                 num_pages=64))
    app, loop = make_app(eng, served_name="tiny")
    srv = ServerThread(app).start()
    yield SimpleNamespace(url=srv.url, state=app.state.sb)
    srv.stop()
    loop.close()


def test_draining_refuses_new_work_and_says_so(served):
    served.state.draining = True
    try:
        h = httpx.get(served.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        for path, body in (("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", {"messages": []})):
            r = httpx.post(served.url + path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down" and r.headers["retry-after"]
        assert httpx.get(served.url + "/metrics").status_code == 200  # a last scrape still works
    finally:
        served.state.draining = False
    assert httpx.get(served.url + "/health").status_code == 200
