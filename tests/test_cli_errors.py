"""Every failure of every command is one line with the documented exit code (issue 45 item 3).

docs/cli.md "Failures" is the table (condition, message, exit code). Each test here is one row: it brings the
condition about through the real command line (typer's CliRunner in process; a subprocess where a signal is
sent) and checks the exit code the table gives for that row, that the failure is one line naming the command
(`specbench CMD: ...` as the last line on stderr, no traceback), and what the message must say.
`test_the_table_and_the_tests_agree` keeps the table's conditions and the tests' rows the same list. The
endpoints are harness/fake_endpoint.py on 127.0.0.1; a test that signals a command waits for the endpoint to
hold the command's first real request (an event), never for a clock.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from specbench.cli.app import _register, app
from specbench.harness.fake_endpoint import FakeEndpoint, Faults
from specbench.harness.fixtures import bundled_pair

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
TARGET, DRAFT = (str(p) for p in bundled_pair())
TRACE = str(ROOT / "tests" / "data" / "traces" / "hta_triton_example_a100.json.gz")
VLLM_FILE = str(next((ROOT / "tests" / "data" / "vllm_bench").glob("*.json")))
KEY, WRONG = "sk-the-right-key-4711", "sk-a-wrong-key-0815"
ROWS: dict[str, str] = {}  # condition (docs/cli.md) -> the test of that row


def row(condition: str):
    def mark(fn):
        ROWS[condition] = fn.__name__
        return fn
    return mark


def table() -> dict[str, str]:
    """docs/cli.md "Failures": condition -> its exit code cell."""
    text = DOC.read_text(encoding="utf-8").split("\n## Failures\n", 1)[1].split("\n## ", 1)[0]
    rows = [ln.split(" | ") for ln in text.splitlines() if ln.startswith("| ") and not ln.startswith("| condition")]
    return {r[0].removeprefix("| ").strip(): r[-1].removesuffix("|").strip() for r in rows}


def code(condition: str) -> int:
    return int(table()[condition])


def cli(args: list[str]):
    _register()
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert not r.exception or isinstance(r.exception, SystemExit), r.output  # a traceback is a bug
    return r


def failure_line(r, command: str) -> str:
    """The failure: the last line on stderr, `specbench COMMAND: ...`, the only such line, no traceback."""
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert err and err[-1].startswith(f"specbench {command}: "), r.stderr
    assert sum(ln.startswith(f"specbench {command}: ") for ln in err) == 1, r.stderr
    assert "Traceback" not in r.output and "╭" not in r.stderr, r.output
    return err[-1]


@pytest.fixture()
def closed_port():
    """A port bound but not listening: connecting to it is refused, and no one else can take it meanwhile."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


# ---- the table and the tests ------------------------------------------------------------------------------
def test_the_table_and_the_tests_agree() -> None:
    t = table()
    assert set(t) == set(ROWS), (set(t) ^ set(ROWS))
    assert all(re.fullmatch(r"\d+|the failure's", c) for c in t.values()), t


# ---- usage ------------------------------------------------------------------------------------------------
@row("a bad flag value, an unknown option, a missing option")
@pytest.mark.parametrize("args, says", [
    (["sweep", "--concurrency", "0"], "Invalid value for --concurrency"),
    (["lossless", "--num-prompts", "0"], "Invalid value for '--num-prompts'"),
    (["lossless", "--bogus"], "No such option: --bogus"),
    (["generate"], "Missing option '--prompt'"),
])
def test_click_usage_errors_are_one_line(args, says) -> None:
    r = cli(args)
    assert r.exit_code == code("a bad flag value, an unknown option, a missing option")
    assert says in failure_line(r, args[0])
    assert "Usage:" not in r.output and "--help" not in r.stderr  # no usage box


@row("a flag value the command itself refuses")
def test_a_refused_flag_value_names_the_flag() -> None:
    r = cli(["lossless", "--dataset", "nope"])
    assert r.exit_code == code("a flag value the command itself refuses")
    assert "--dataset 'nope' is invalid: expected one of gsm8k" in failure_line(r, "lossless")


@row("an engine string that cannot be parsed")
@pytest.mark.parametrize("engine", ["nokind:abc", "local,bogus=1"])
def test_a_bad_engine_string(engine) -> None:
    r = cli(["generate", "-p", "hi", "-e", engine])
    assert r.exit_code == code("an engine string that cannot be parsed")
    assert f"engine string {engine!r}" in failure_line(r, "generate")


@row("an optional feature without its extra")
def test_a_missing_extra(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    r = cli(["generate", "-p", "hi", "-e", f"hf:{TARGET}"])
    assert r.exit_code == code("an optional feature without its extra")
    assert "pip install 'specbench[hf]'" in failure_line(r, "generate")


# ---- endpoints --------------------------------------------------------------------------------------------
def _endpoint_commands(e: str) -> dict[str, list[str]]:
    """Every command that talks to an endpoint, pointed at `e` (the smallest run of each)."""
    return {
        "lossless": ["lossless", "--baseline", e, "--candidate", e, "--quick", "--no-record", "-q"],
        "lossless --suite prefix": ["lossless", "--suite", "prefix", "--candidate", e, "--no-record"],
        "sampled": ["sampled", "--baseline", e, "--candidate", e, "--no-record", "-q"],
        "sweep": ["sweep", "--arms", e, "-c", "1", "--num-prompts", "2", "--max-tokens", "4", "--rounds", "1",
                  "--no-record", "-q"],
        "tune": ["tune", "--arms", f"a={e};b={e}", "-c", "1", "--max-tokens", "4", "--rounds", "1", "--no-record",
                 "-q"],
        "generate": ["generate", "-p", "hi", "-e", e],
        "eval": ["eval", "--baseline", e, "--candidate", e, "--limit", "1", "--no-record", "-q"],
        "check-draft": ["check-draft", DRAFT, "--engine", e],
    }


ENDPOINT_COMMANDS = list(_endpoint_commands("x"))


@row("an endpoint that refuses the key (HTTP 401 or 403)")
@pytest.mark.parametrize("guard", ["401 everywhere", "403, models open"])
@pytest.mark.parametrize("which", ENDPOINT_COMMANDS)
def test_a_refused_key_is_one_line_exit_2_on_every_endpoint_command(which, guard) -> None:
    faults = Faults(api_key=KEY) if guard.startswith("401") else \
        Faults(api_key=KEY, auth_status=403, open_paths=("/v1/models",))  # llama-server lists models to anyone
    with FakeEndpoint(faults=faults) as ep:
        r = cli(_endpoint_commands(f"openai:{ep.url},api_key={WRONG}")[which])
    assert r.exit_code == code("an endpoint that refuses the key (HTTP 401 or 403)"), r.output
    line = failure_line(r, which.split()[0])
    assert f"the endpoint {ep.url} refused authentication (HTTP {guard[:3]} on " in line
    assert "the key from api_key= was refused" in line and "api_key=<key> in the engine string" in line
    assert WRONG not in r.output and KEY not in r.output


def test_the_right_key_is_not_refused() -> None:
    """The other way: the same endpoint and commands with its key run (generate: 0; sweep: 0)."""
    with FakeEndpoint(faults=Faults(api_key=KEY)) as ep:
        cmds = _endpoint_commands(f"openai:{ep.url},api_key={KEY}")
        g, s = cli(cmds["generate"]), cli(cmds["sweep"])
        sent = {x["headers"].get("authorization") for x in ep.seen if x["path"] == "/v1/completions"}
    assert g.exit_code == 0 and s.exit_code == 0, g.output + s.output
    assert sent == {f"Bearer {KEY}"} and KEY not in g.output + s.output


def test_sweep_names_its_api_key_flag() -> None:
    with FakeEndpoint(faults=Faults(api_key=KEY)) as ep:
        r = cli(_endpoint_commands(f"openai:{ep.url}")["sweep"] + ["--api-key", WRONG])
    line = failure_line(r, "sweep")
    assert r.exit_code == 2 and "the key from --api-key was refused" in line and "or --api-key <key>" in line
    assert WRONG not in r.output


@row("an endpoint where nothing answers")
@pytest.mark.parametrize("which", ["lossless", "sweep", "generate", "eval"])
def test_an_endpoint_where_nothing_answers(which, closed_port) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    r = cli(_endpoint_commands(f"openai:{url}")[which])
    assert r.exit_code == code("an endpoint where nothing answers"), r.output
    assert f"the endpoint {url} does not answer" in failure_line(r, which)


@row("an endpoint that names no model")
def test_an_endpoint_that_names_no_model() -> None:
    with FakeEndpoint(faults=Faults(no_models=True)) as ep:
        r = cli(["generate", "-p", "hi", "-e", f"openai:{ep.url}"])
        ok = cli(["generate", "-p", "hi", "-e", f"openai:{ep.url},model=fake-model"])
    assert r.exit_code == code("an endpoint that names no model")
    assert "names no model" in failure_line(r, "generate") and "model=<name>" in r.stderr
    assert ok.exit_code == 0, ok.output  # the other way: told its model, it serves


@row("an endpoint whose first requests fail (the sweep's one-token probe, sampled's echo prompts)")
@pytest.mark.parametrize("which, says", [("sweep", "a one-token probe request failed before the sweep"),
                                         ("sampled", "the baseline failed the greedy generations")])
def test_an_endpoint_whose_first_requests_fail(which, says) -> None:
    with FakeEndpoint(faults=Faults(fail_first=10**6)) as ep:  # every attempt answers 503
        r = cli(_endpoint_commands(f"openai:{ep.url},retries=0")[which])
    assert r.exit_code == code("an endpoint whose first requests fail (the sweep's one-token probe, sampled's echo "
                               "prompts)"), r.output
    assert says in failure_line(r, which)


@row("an endpoint without token ids (lossless)")
def test_an_endpoint_without_token_ids_cannot_be_tested() -> None:
    with FakeEndpoint() as ep:
        r = cli(_endpoint_commands(f"openai:{ep.url}")["lossless"])
    assert r.exit_code == code("an endpoint without token ids (lossless)"), r.output
    verdict = [ln for ln in r.stdout.splitlines() if ln.startswith("VERDICT:")]
    assert verdict and verdict[0].startswith("VERDICT: CANNOT TEST [missing: tokenize"), r.stdout


# ---- measurements -----------------------------------------------------------------------------------------
@row("a sweep or tune answered with no output token")
@pytest.mark.parametrize("which", ["sweep", "tune"])
def test_no_output_tokens_is_cannot_test(which) -> None:
    with FakeEndpoint(faults=Faults(empty=True)) as ep:
        r = cli(_endpoint_commands(f"openai:{ep.url}")[which])
    with FakeEndpoint() as ep:
        ok = cli(_endpoint_commands(f"openai:{ep.url}")[which])
    assert r.exit_code == code("a sweep or tune answered with no output token"), r.output
    line = failure_line(r, which)
    assert "no output tokens in" in line and "c1 r0" in line and line.endswith("CANNOT TEST")
    if which == "sweep":
        assert "NO OUTPUT TOKENS" in r.stdout
    assert ok.exit_code == 0 and "no output tokens" not in ok.output, ok.output  # tokens: a measurement


@row("a sweep whose requests failed past their retries")
def test_failed_requests_exit_4(tmp_path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("one", "FAILME two", "three")))
    with FakeEndpoint(faults=Faults(fail_marker="FAILME")) as ep:
        r = cli(["sweep", "--arms", f"openai:{ep.url},retries=0", "-c", "1", "--dataset", "custom", "--dataset-path",
                 data, "--num-prompts", "3", "--max-tokens", "4", "--rounds", "1", "--warmup", "0", "--no-noise-floor",
                 "--no-record", "-q"])
    assert r.exit_code == code("a sweep whose requests failed past their retries"), r.output
    assert "complete_with_failures" in r.stdout and "exit 4 (--allow-failures to accept)" in r.stderr


@row("a check failed")
def test_a_failed_check_exits_1() -> None:
    """A real bug (skip_rollback: the KV cache keeps rejected drafts) fails the gate; the clean engine passes it."""
    args = ["lossless", "--quick", "--num-prompts", "2", "--max-tokens", "32", "--no-record", "-q", "--no-check-draft"]
    r = cli([*args, "--candidate", "local,faults=skip_rollback"])
    ok = cli([*args, "--candidate", "local"])
    assert r.exit_code == code("a check failed") and "VERDICT: FAIL" in r.stdout, r.output
    assert ok.exit_code == 0 and "VERDICT: PASS" in ok.stdout, ok.output


# ---- the gates' own evidence (docs/lossless.md "Verdicts"; tests/test_verdict_evidence.py for every gate) ----------
def _gate_commands(e: str) -> dict[str, list[str]]:
    return {"lossless": ["lossless", "--baseline", e, "--candidate", e, "--num-prompts", "2", "--max-tokens", "6",
                         "--no-record", "-q"],
            "sampled": ["sampled", "--baseline", e, "--candidate", e, "--num-prompts", "1", "--positions", "3",
                        "--samples", "48", "--configs", "t=1.0", "--permutations", "99", "--seed-repeat", "0",
                        "--prompt-set", "gsm8k", "--no-record", "-q"]}


def _verdict(r, which: str) -> str:
    head = "VERDICT: " if which == "lossless" else "sampled gate: "
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(head)]
    assert lines, r.output
    return lines[-1].removeprefix(head)


@row("an endpoint that answers no token (lossless, sampled)")
@pytest.mark.parametrize("which", ["lossless", "sampled"])
def test_an_endpoint_that_answers_no_token_cannot_be_tested(which) -> None:
    from dialect_fakes import FakeServer, serving

    with serving(FakeServer("vllm", empty=True, metrics=False)) as url:  # ids and logprobs claimed, no token
        r = cli(_gate_commands(f"openai:{url}")[which])
    assert r.exit_code == code("an endpoint that answers no token (lossless, sampled)"), r.output
    v = _verdict(r, which)
    assert v.startswith("CANNOT TEST [missing: ") and "no token" in v, v


@row("no evidence that the candidate speculated (lossless, sampled)")
@pytest.mark.parametrize("which", ["lossless", "sampled"])
def test_no_evidence_of_speculation_cannot_be_tested_unless_asserted(which) -> None:
    from dialect_fakes import FakeServer, serving

    with serving(FakeServer("vllm", metrics=False)) as url:  # the same tokens on both arms, nothing shows drafts
        r = cli(_gate_commands(f"openai:{url}")[which])
        told = cli([*_gate_commands(f"openai:{url}")[which], "--assume-speculating"])
    assert r.exit_code == code("no evidence that the candidate speculated (lossless, sampled)"), r.output
    assert _verdict(r, which).startswith("CANNOT TEST [missing: ") and "evidence that the candidate speculated" in \
        _verdict(r, which)
    assert told.exit_code == 0 and _verdict(told, which).startswith(
        "PASS (speculation asserted by the user, not observed)"), told.output


@row("`--margin-tol` with `--strict` (lossless)")
def test_a_typed_margin_with_strict_is_refused() -> None:
    r = cli(["lossless", "--margin-tol", "0.2", "--strict", "--quick", "--no-record", "-q"])
    assert r.exit_code == code("`--margin-tol` with `--strict` (lossless)"), r.output
    assert "--margin-tol 0.2 and --strict contradict each other" in failure_line(r, "lossless")


# ---- output paths ------------------------------------------------------------------------------------------
def _blocked(f: Path) -> dict[str, list[str]]:
    """Every output-path option, given a path under the regular file `f` (nothing can be made there)."""
    p = str(f / "sub" / "x")
    return {"lossless --report": ["lossless", "--report", p], "sampled --report": ["sampled", "--report", p],
            "selftest --report": ["selftest", "--report", p], "eval --report": ["eval", "--report", p],
            "sweep --report": ["sweep", "--report", p], "sweep --result-dir": ["sweep", "--result-dir", p],
            "sweep --results-dir": ["sweep", "--results-dir", p], "tune --json": ["tune", "--json", p],
            "tune --report": ["tune", "--report", p], "tune --merge-into": ["tune", "--merge-into", p],
            "gaps --plot": ["gaps", TRACE, "--plot", p], "gaps --report": ["gaps", TRACE, "--report", p],
            "gaps --results-dir": ["gaps", TRACE, "--results-dir", p], "report --out": ["report", "x", "--out", p],
            "bench-decode --out": ["bench-decode", "--out", p], "bench-decode --workdir": ["bench-decode", "--workdir", p],
            "profile --out": ["profile", "--out", p], "fixtures --out": ["fixtures", "--out", p],
            "import --results-dir": ["import", "vllm-bench", VLLM_FILE, "--results-dir", p],
            "lossless --results-dir": ["lossless", "--results-dir", p]}


@row("an output path that cannot be made")
@pytest.mark.parametrize("which", list(_blocked(Path("f"))))
def test_an_output_path_that_cannot_be_made_is_refused_before_anything_runs(which, tmp_path) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    args = _blocked(f)[which]
    r = cli(args)
    assert r.exit_code == code("an output path that cannot be made"), r.output
    line = failure_line(r, args[0])
    assert f"{which.split()[1]} '{f}/sub/x' is invalid: '{f}' is a file, so no folder can be made under it" in line
    assert f.read_text() == "x" and r.stdout == ""  # refused before the command ran


def test_a_folder_where_a_file_is_wanted(tmp_path) -> None:
    r = cli(["gaps", TRACE, "--plot", tmp_path, "--no-record", "--json"])
    assert r.exit_code == 2 and "it is a folder (expected a file path)" in failure_line(r, "gaps")


@row("an output folder that does not exist yet")
def test_a_missing_output_folder_is_made(tmp_path) -> None:
    plot, md = tmp_path / "a" / "b" / "idle.png", tmp_path / "c" / "gaps.md"
    r = cli(["gaps", TRACE, "--plot", plot, "--report", md, "--results-dir", tmp_path / "new" / "store"])
    assert r.exit_code == code("an output folder that does not exist yet"), r.output
    assert plot.stat().st_size > 0 and "idle.png" in md.read_text() and (tmp_path / "new" / "store").is_dir()


def test_every_option_that_writes_is_an_output_path() -> None:
    """A new option whose help says it writes somewhere must come under the output-path policy (cli/flags.py)."""
    import typer.main

    from specbench.cli.flags import output_kind

    _register()
    missed = []
    for name, cmd in typer.main.get_command(app).commands.items():
        for p in cmd.params:
            opts = getattr(p, "opts", None) or []
            if not opts or getattr(p, "is_flag", False) or not opts[0].startswith("-"):
                continue
            if re.search(r"(?<!never )\bwrit(e|ten)\b|\bdirectory for\b|where to build", (p.help or "").lower()) \
                    and output_kind(name, opts) is None:
                missed.append(f"{name} {opts[0]}")
    assert not missed, missed


# ---- no CUDA ------------------------------------------------------------------------------------------------
@row("no CUDA GPU where one is needed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("args", [
    ["bench-decode", "--quick"],
    ["profile", "--device", "cuda", "--steps", "1"],
    ["generate", "-p", "hi", "-e", "local,device=cuda"],
    ["fixtures", "--out", "{tmp}/pair", "--shape", "qwen3-4b", "--device", "cuda"],
])
def test_no_cuda_is_cannot_test(args, tmp_path) -> None:
    r = cli([a.replace("{tmp}", str(tmp_path)) for a in args])
    assert r.exit_code == code("no CUDA GPU where one is needed"), r.output
    assert "needs a CUDA GPU" in failure_line(r, args[0])


def test_require_device_both_ways(monkeypatch) -> None:
    """The rule itself: cpu always passes; cuda raises exactly where torch sees no CUDA GPU."""
    from specbench.engine.config import DeviceUnavailable, require_device

    require_device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailable, match="needs a CUDA GPU"):
        require_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    require_device("cuda")
    require_device("cuda:0")
    with pytest.raises(DeviceUnavailable, match="CUDA GPU 3"):
        require_device("cuda:3")


# ---- --json --------------------------------------------------------------------------------------------------
@row("any of the failures above with `--json`")
@pytest.mark.parametrize("case", ["usage", "refused value", "unreadable trace", "refused key", "no CUDA"])
def test_json_failures_are_json(case, tmp_path) -> None:
    if case == "no CUDA" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with FakeEndpoint(faults=Faults(api_key=KEY)) as ep:
        args, want = {"usage": (["lossless", "--json", "--num-prompts", "0"], 2),
                      "refused value": (["eval", "--json", "--task", "no-such-task"], 2),
                      "unreadable trace": (["gaps", "--json", tmp_path / "none.json", "--no-record"], 2),
                      "refused key": (["generate", "--json", "-p", "hi", "-e", f"openai:{ep.url}"], 2),
                      "no CUDA": (["profile", "--json", "--device", "cuda", "--out", tmp_path], 3)}[case]
        r = cli(args)
    assert table()["any of the failures above with `--json`"] == "the failure's" and r.exit_code == want
    doc = json.loads(r.stdout)  # stdout is exactly one JSON document
    assert doc["command"] == args[0] and doc["exit_code"] == want and doc["error"] in failure_line(r, args[0])
    assert doc.get("verdict") == ("CANNOT TEST" if want == 3 else None)


@row("profile --json without a GPU timeline (on the CPU)")
def test_profile_json_on_the_cpu_is_json(tmp_path) -> None:
    r = cli(["profile", "--json", "--steps", "3", "--max-tokens", "16", "--out", tmp_path / "prof"])
    assert r.exit_code == code("profile --json without a GPU timeline (on the CPU)"), r.output
    doc = json.loads(r.stdout)
    assert doc["profile"]["steps"] >= 1 and {"draft", "verify"} <= set(doc["profile"]["host_ms"])
    if doc["gaps"] is None:  # on the CPU: no GPU timeline, and the reason
        assert doc["gaps_missing"].startswith("no GPU timeline to attribute")
    assert "profiled" in r.stderr  # the progress lines, off stdout


# ---- signals --------------------------------------------------------------------------------------------------
def _signalled(args: list[str], sig: int, tmp_path: Path, ignore_sigint: bool = False) -> tuple[int, str, str]:
    """Run `specbench ARGS` against a fake endpoint that holds every real request (16+ tokens); once the first
    is held (the command is mid-run), send `sig`; return (exit code, stdout, stderr)."""
    with FakeEndpoint(token_id=5, hold_from=16) as ep:
        argv = [sys.executable, "-m", "specbench", *[a.replace("URL", ep.url) for a in args]]
        pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                             preexec_fn=pre, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            assert ep.held.wait(300), "the command never reached its first request"
            p.send_signal(sig)
            out, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
    return p.returncode, out, err


SIGNALLED = {
    "sweep": ["sweep", "--arms", "openai:URL", "-c", "1", "--max-tokens", "32", "--warmup", "0", "--results-dir", "res"],
    "tune": ["tune", "--arms", "a=openai:URL;b=openai:URL", "-c", "1", "--max-tokens", "32", "--warmup", "0",
             "--results-dir", "res"],
    "lossless": ["lossless", "--baseline", "openai:URL", "--candidate", "openai:URL", "--tokenizer", TARGET, "--quick",
                 "--max-tokens", "32", "--results-dir", "res"],
    "sampled": ["sampled", "--baseline", "openai:URL", "--candidate", "openai:URL", "--positions", "16", "--samples", "4",
                "--results-dir", "res"],
}


def _check_stopped(which: str, rc: int, out: str, err: str, tmp_path: Path, how: str) -> None:
    assert "Traceback" not in err and "Task exception was never retrieved" not in err, err
    if which == "sweep":  # the sweep says it on its records line, then its summary
        assert f"INCOMPLETE ({how}; every finished record kept)" in out, out
    else:
        last = [ln for ln in err.splitlines() if ln.strip()][-1]
        assert last.startswith(f"specbench {which}: {how}"), err
    runs = [json.loads(f.read_text()) for f in (tmp_path / "res").glob("*/run.json")]
    assert runs and all(r["status"] == "incomplete" for r in runs), runs  # the records are kept, marked
    assert all(r["error"].startswith("interrupted" + (" (SIGTERM)" if "SIGTERM" in how else "")) for r in runs), runs


@row("Ctrl-C (SIGINT)")
@pytest.mark.parametrize("which", ["sweep", "lossless"])
def test_sigint_stops_cleanly(which, tmp_path) -> None:
    rc, out, err = _signalled(SIGNALLED[which], signal.SIGINT, tmp_path)
    assert rc == code("Ctrl-C (SIGINT)"), err
    _check_stopped(which, rc, out, err, tmp_path, "interrupted")


@row("SIGTERM")
@pytest.mark.parametrize("which", list(SIGNALLED))
def test_sigterm_stops_as_cleanly_as_sigint(which, tmp_path) -> None:
    rc, out, err = _signalled(SIGNALLED[which], signal.SIGTERM, tmp_path)
    assert rc == code("SIGTERM"), err
    _check_stopped(which, rc, out, err, tmp_path, "terminated (SIGTERM)")


def test_sigterm_where_sigint_is_ignored(tmp_path) -> None:
    """A job a script started with `&` ignores SIGINT: SIGTERM still stops a sweep cleanly (it used to raise in the
    middle of the event loop: 'Task exception was never retrieved')."""
    rc, out, err = _signalled(SIGNALLED["sweep"], signal.SIGTERM, tmp_path, ignore_sigint=True)
    assert rc == code("SIGTERM"), err
    _check_stopped("sweep", rc, out, err, tmp_path, "terminated (SIGTERM)")


def test_ignored_sigint_stays_ignored(tmp_path) -> None:
    """The other way: where SIGINT is ignored, Ctrl-C still does nothing; the sweep finishes once released."""
    with FakeEndpoint(hold_from=16) as ep:
        args = [a.replace("URL", ep.url) for a in SIGNALLED["sweep"]] + ["--num-prompts", "2", "--rounds", "1",
                                                                         "--no-noise-floor", "-q"]
        p = subprocess.Popen([sys.executable, "-m", "specbench", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        try:
            assert ep.held.wait(300)
            p.send_signal(signal.SIGINT)
            ep.release()
            out, err = p.communicate(timeout=300)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 0 and "(complete)" in out, out + err
