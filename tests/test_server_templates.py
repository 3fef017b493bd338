"""Chat templates bounded in time, memory and output (issue 45; engine/chat_template.py, harness/server/chat.py).

A template that builds 'x' * 10**9, or nests two range(100000) loops, used to take the server with it: 33 s of
start-up and a gigabyte per chat request, or a render that never ended, ignored SIGTERM and grew the server to
12.6 GB. Now every render runs in a worker process: past its output bound, its memory (RLIMIT_AS) or its time
(the worker killed) the request gets a 400 naming messages and the server keeps serving; such a template on a
plain conversation is refused at start-up in one line; SIGTERM during a render that never ends still shuts the
server down, and the worker goes with it. Every wait below ends on an event (an answer, a busy worker, an exit);
the timeouts are hang guards.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from specbench.benchmarks.server_health import TEMPLATES, TRAPS, template_model
from specbench.engine import EngineConfig, LLMEngine
from specbench.engine.chat_template import BoundedRenderer, TemplateRefused
from specbench.harness.server import ServerOptions, ServerThread, make_app
from specbench.harness.server.chat import probe_template

GUARD_S = 300.0  # hang guards only


@pytest.fixture(scope="module")
def served(tiny_target, tmp_path_factory):
    model = template_model("trap", tmp_path_factory.mktemp("trap"))
    eng = LLMEngine(EngineConfig(model=str(model), num_pages=128))
    # a timeout no bounded trap comes near on a loaded machine (a gigabyte by doubling took 3.7 s at load 16); the
    # test of the timeout itself shortens it
    app, loop = make_app(eng, served_name="tiny", options=ServerOptions(chat_template_timeout=GUARD_S / 5))
    srv = ServerThread(app).start()
    client = httpx.Client(base_url=srv.url, timeout=GUARD_S)
    yield SimpleNamespace(url=srv.url, client=client, state=app.state.sb, engine=eng)
    client.close()
    srv.stop()
    loop.close()


def _chat(served, content: str) -> httpx.Response:
    return served.client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                            "max_tokens": 2})


@pytest.mark.parametrize(("trap", "code"), [
    ("big", "chat_template_too_large"),  # refused at the '*', nothing built
    ("flood", "chat_template_too_large"),  # counted as it is produced
    ("wide", "chat_template_memory"),  # a gigabyte from a filter: past the worker's RLIMIT_AS
    ("double", "chat_template_memory"),
    ("refuse", "invalid_value"),  # raise_exception: the template's own 400, its message kept
])
def test_a_template_past_a_bound_is_a_400_and_the_server_serves_on(served, trap, code):
    r = _chat(served, trap)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and err["code"] == code, r.text
    assert err["message"].startswith("messages cannot be rendered with the chat template")
    if trap == "refuse":
        assert "the trap refuses this conversation" in err["message"]
    assert _chat(served, "hello").status_code == 200
    assert served.client.get("/health").json()["status"] == "ok"
    assert served.state.templates.workers <= served.state.options.prep_threads


def test_a_template_that_never_ends_is_cut_at_its_timeout_while_others_are_served(served, monkeypatch):
    """The spinning render holds one worker process; meanwhile /health and other chat requests answer (other
    workers). At the timeout that worker is killed: 400 chat_template_timeout, and no worker is left spinning."""
    monkeypatch.setattr(served.state.templates, "timeout", 2.0)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _chat(served, "spin")))
    t.start()
    assert _wait(lambda: served.state.templates.rendering >= 1), "the render never reached a worker"
    spinning = set(served.state.templates.pids())
    assert served.client.get("/health").json()["status"] == "ok"
    assert _chat(served, "hello").status_code == 200
    t.join(GUARD_S)
    err = out["r"].json()["error"]
    assert out["r"].status_code == 400 and err["code"] == "chat_template_timeout", out["r"].text
    assert "--chat-template-timeout" in err["message"] and err["param"] == "messages"
    assert served.state.templates.rendering == 0
    dead = [p for p in spinning if not _alive(p)]
    assert len(dead) == 1 and dead[0] not in served.state.templates.pids(), (spinning, dead)  # the spinning one
    assert all(p in served.state.templates.pids() for p in spinning if p not in dead)  # the others kept
    assert _chat(served, "hello").status_code == 200


def _wait(cond, guard: float = GUARD_S) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < guard:
        if cond():
            return True
        time.sleep(0.02)
    return False


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(fields[11]) + int(fields[12])  # utime + stime


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_the_probe_refuses_a_template_that_trips_a_bound(tiny_target, tmp_path):
    from specbench.engine.tokenizer import Tokenizer

    for name, what, timeout in (("big", "more than 1,048,576 characters", GUARD_S / 5),
                                ("spin", "did not finish rendering", 1.0)):
        (tmp_path / name).mkdir()
        tok = Tokenizer(str(template_model(name, tmp_path / name)))
        msg = probe_template(tok, timeout=timeout)
        assert msg and what in msg and "chat_template" in msg and "\n" not in msg, msg
    tok = Tokenizer(tiny_target)
    assert probe_template(tok, timeout=GUARD_S / 5) is None


def _serve(model: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specbench", "serve", "--model", str(model), "--spec", "off",
                             "--port", "0", "--no-warmup", "--num-pages", "128", "--log-level", "warning", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("name", ["big", "spin"])
def test_serve_refuses_such_a_template_at_start_in_one_line(tmp_path, name):
    p = _serve(template_model(name, tmp_path), "--chat-template-timeout", "1")
    try:
        rc = p.wait(GUARD_S)
    finally:
        if p.poll() is None:
            p.kill()
    err = p.stderr.read().strip() if p.stderr else ""
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("specbench serve: --model=") and "fix tokenizer_config.json's chat_template" in err, err


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with open(task / "children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_sigterm_during_a_render_that_never_ends(tmp_path):
    """`specbench serve` with the trap template and no practical render timeout: a chat request makes its
    template spin; once its worker burns CPU, SIGTERM. The server exits 0 with its one line within the grace
    period's reach, the waiting client gets 503 shutting_down, and the spinning worker is gone."""
    p = _serve(template_model("trap", tmp_path), "--chat-template-timeout", "600", "--shutdown-timeout", "1")
    try:
        first = p.stderr.readline() if p.stderr else ""
        m = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", first)
        assert m, first
        url = f"http://127.0.0.1:{m.group(1)}"
        t0 = time.monotonic()
        while time.monotonic() - t0 < GUARD_S:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        out: dict = {}

        def spin() -> None:
            try:
                out["r"] = httpx.post(url + "/v1/chat/completions", timeout=GUARD_S,
                                      json={"messages": [{"role": "user", "content": "spin"}], "max_tokens": 2})
            except httpx.HTTPError as e:
                out["e"] = e

        t = threading.Thread(target=spin)
        t.start()
        # the server's first worker starts for this request (the start-up probe's is gone); past a second of CPU
        # it is spinning (python and jinja2 start in a tenth of that)
        workers: list[int] = []
        assert _wait(lambda: workers.extend(c for c in _children(p.pid) if "chat_template.py" in _cmdline(c)
                                            and _cpu_ticks(c) > 100) or workers), "the render never started"
        assert httpx.get(url + "/health", timeout=GUARD_S).json()["status"] == "ok"
        p.send_signal(signal.SIGTERM)
        rc = p.wait(GUARD_S)
        t.join(GUARD_S)
    finally:
        if p.poll() is None:
            p.kill()
    err = (p.stderr.read() if p.stderr else "").strip()
    assert rc == 0 and "Traceback" not in err, err
    assert re.fullmatch(r"specbench serve: shut down on SIGTERM in \d+\.\d s: 0 in-flight requests finished, "
                        r"0 aborted \(--shutdown-timeout 1 s\)", err), err
    r = out.get("r")
    assert r is not None and r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", out
    for w in workers:
        assert not _alive(w), f"worker {w} outlived the server"


KINDS = {"big": "too_large", "flood": "too_large", "wide": "memory", "double": "memory", "refuse": "error",
         "spin": "timeout"}


@pytest.mark.parametrize("trap", sorted(TRAPS))
def test_the_renderer_alone_bounds_each_trap(trap):
    """The renderer without a server: every trap ends in its own refusal (never text), the worker count stays
    bounded, the next render is served, and close() leaves no process."""
    assert set(KINDS) == set(TRAPS)
    r = BoundedRenderer(timeout=1.0 if trap == "spin" else GUARD_S / 5, max_workers=2)
    try:
        with pytest.raises(TemplateRefused) as e:
            r.render(TEMPLATES["trap"], [{"role": "user", "content": trap}], True, "", 1 << 20)
        assert e.value.kind == KINDS[trap], (e.value.kind, e.value.message)
        r.timeout = GUARD_S / 5
        assert r.render(TEMPLATES["trap"], [{"role": "user", "content": "hi"}], True, "", 1 << 20).endswith(
            "<|im_start|>assistant\n")
        pids = r.pids()
        assert 1 <= len(pids) <= 2
    finally:
        r.close()
    assert r.workers == 0 and not any(_alive(p) for p in pids)
    with pytest.raises(TemplateRefused) as e:
        r.render(TEMPLATES["trap"], [{"role": "user", "content": "hi"}], True, "", 1 << 20)
    assert e.value.kind == "closed"


def test_a_worker_whose_parent_dies_exits(tmp_path):
    """A server killed outright (SIGKILL, the OOM killer) cannot kill its workers: they see it gone and exit."""
    code = ("import sys, json\n"
            "from specbench.engine.chat_template import BoundedRenderer\n"
            "r = BoundedRenderer(timeout=600)\n"
            "import threading\n"
            "threading.Thread(target=r.render, args=(sys.argv[1], [{'role': 'user', 'content': 'spin'}], True, '',"
            " 1 << 20), daemon=True).start()\n"
            "import time\n"
            "while not r.pids(): time.sleep(0.01)\n"
            "print(json.dumps(r.pids()), flush=True)\n"
            "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", code, TEMPLATES["trap"]], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = json.loads(p.stdout.readline() if p.stdout else "[]")
        assert pids
        p.kill()
        p.wait(GUARD_S)
        assert _wait(lambda: not any(_alive(w) for w in pids)), "a worker outlived its parent"
    finally:
        if p.poll() is None:
            p.kill()
        for w in pids:
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def test_a_worker_killed_while_idle_is_replaced_not_handed_a_render():
    """An idle worker killed from outside (the OOM killer, an operator) costs the next render nothing."""
    r = BoundedRenderer(timeout=GUARD_S, max_workers=1)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        assert r.render("{{ messages[0]['content'] }}", msgs, True, "", 100) == "hi"
        (pid,) = r.pids()
        os.kill(pid, signal.SIGKILL)
        assert _wait(lambda: not _alive(pid))
        assert r.render("{{ messages[0]['content'] }}", msgs, True, "", 100) == "hi"
        assert r.pids() and pid not in r.pids()
    finally:
        r.close()


def test_a_worker_killed_just_before_its_next_render_costs_that_render_nothing():
    """No wait between the kill and the render: the pool's liveness check may still see the worker running (its
    second thread still exiting), so the render reaches a dead worker; it is retried on a fresh one."""
    r = BoundedRenderer(timeout=GUARD_S, max_workers=2)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        for _ in range(5):
            assert r.render("{{ messages[0]['content'] }}", msgs, True, "", 100) == "hi"
            for pid in r.pids():
                os.kill(pid, signal.SIGKILL)
            assert r.render("{{ messages[0]['content'] }}", msgs, True, "", 100) == "hi"
    finally:
        r.close()


def _render_in_thread(r, out: dict) -> threading.Thread:
    def go():
        try:
            out["text"] = r.render(TEMPLATES["trap"], [{"role": "user", "content": "spin"}], True, "", 1 << 20)
        except TemplateRefused as e:
            out["kind"] = e.kind
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _kill_the_rendering_worker(r, not_pids=()) -> int:
    pids: list[int] = []
    assert _wait(lambda: r.rendering == 1 and bool(pids.extend(p for p in r.pids() if p not in not_pids) or pids))
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


@pytest.mark.parametrize("reused", [False, True])
def test_a_worker_killed_during_a_render_is_retried_at_most_once(reused):
    """A fresh worker killed mid-render: refused as `died`. A reused one: the render cannot tell that from a death
    between renders, so it goes once more to a fresh worker, and that one killed too is `died` (no second retry)."""
    r = BoundedRenderer(timeout=GUARD_S, max_workers=1)
    out: dict = {}
    try:
        if reused:
            assert r.render("{{ messages[0]['content'] }}", [{"role": "user", "content": "hi"}], True, "", 9) == "hi"
        t = _render_in_thread(r, out)
        first = _kill_the_rendering_worker(r)
        if reused:
            _kill_the_rendering_worker(r, not_pids=(first,))
        t.join(GUARD_S)
        assert not t.is_alive() and out == {"kind": "died"}, out
    finally:
        r.close()
