#!/usr/bin/env python3
"""vLLM as a subject (issue 28): start vLLM and bundled-engine servers, run specbench's suites against them, stop them.

Run by `scripts/gpu.sh vllm|vllm-gates|vllm-speed` on a GPU machine where vLLM is importable from VLLM_SITE
(default /tmp/site-vllm, ../shared/device/vllm/stage.sh) and the bundled engine's FlashInfer from SB_SITE
(default /tmp/site-sb). A user with `pip install vllm==0.26.0` sets VLLM_SITE= (empty: vLLM from the
interpreter's own site-packages) and SB_SITE= (docs/vllm.md).

Parts (--part):
  gates  vLLM spec off vs DFlash on the tiny trained pairs (tiny = the bundled fixture, its drafter taps the
         target's last layer; tiny-l12 = the same target with a drafter tapping layers 1 and 2, which vLLM and
         the bundled engine read the same way): lossless (+ --concurrent, --engine-gates), sampled (+ --null);
         vLLM spec off vs its n-gram proposer on the Qwen3-4B-shaped pair: lossless (+ --concurrent), and on the
         tiny trained target (tiny-ngram: it repeats its own worked-answer phrases, so the lookup is accepted,
         ~2 tokens per step on the bundled engine): lossless (+ --concurrent), sampled (+ --null, last);
         prefix-cache triage on vLLM spec off (the same greedy requests cold, then hitting the cache, and with a
         per-request cache_salt); the bundled engine's acceptance on both tiny pairs and with its n-gram proposer
         on the tiny target (in process, CPU).
  speed  one `specbench sweep` over vLLM off / n-gram and the bundled engine (`specbench serve`) off / n-gram on
         the same GPU and pair, arms interleaved, noise floor, then the summary (ratios per concurrency).
  client `vllm bench serve` (vLLM's own client, in vLLM's interpreter environment) and `specbench sweep` on one
         vLLM server with the same workload, interleaved over rounds (issue 28 item 3): vllm-4b-off on random
         prompts of fixed lengths (the same lengths, not the same tokens), vllm-tiny-l12 (DFlash, real acceptance)
         on the same gsm8k prompts in both; vLLM's files imported with `specbench import vllm-bench`; the
         comparison (suites/sweep/client_compare.py) in client-compare.json / .md. VLLM_CLIENT=1 runs it at the
         start of the speed part too (VLLM_CLIENT=only: instead of the sweep).
  all    gates, then speed.
Servers are started in their own process sessions and recorded in STATE (/tmp/vllm-suite/servers.json), so a
later call on the same machine reuses the healthy ones; --stop stops them all at the end.
Everything lands under --out: servers.json (version, argv, start-up times, memory, log excerpts), one file per
suite run (JSON, markdown), logs/, and summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from specbench.harness.http_json import http
from specbench.harness.verdicts import CANNOT_TEST, FAIL, PASS

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "harness" / "data" / "fixtures"
STATE = Path(os.environ.get("VLLM_SUITE_STATE", "/tmp/vllm-suite/servers.json"))
VLLM_SITE = os.environ.get("VLLM_SITE", "/tmp/site-vllm")
SB_SITE = os.environ.get("SB_SITE", "/tmp/site-sb")
PAIR4B = Path(os.environ.get("SPEC_WORKDIR", "/tmp/q3-4b-pair"))
GiB = 1 << 30
T0 = time.time()
DEADLINE = float(os.environ.get("SUITE_DEADLINE", "540"))


def left() -> float:
    return DEADLINE - (time.time() - T0)


def log(msg: str) -> None:
    print(f"[vllm_suite {time.strftime('%H:%M:%S')} +{time.time() - T0:5.0f}s] {msg}", flush=True)


def env_for(kind: str) -> dict:
    env = os.environ.copy()
    env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if kind == "vllm":  # vLLM alone on its path: the bundled engine's FlashInfer 0.5.3 breaks its warm-up
        env["PYTHONPATH"] = VLLM_SITE
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache for the triage
    else:
        env["PYTHONPATH"] = ":".join(p for p in (SB_SITE, VLLM_SITE) if p)
    if not env["PYTHONPATH"]:
        env.pop("PYTHONPATH")
    return env


# ---- servers ---------------------------------------------------------------------------------------------

def vllm_argv(model: Path, name: str, port: int, max_len: int, kv_gib: float, spec: dict | None,
              opt: int | None = None) -> list[str]:
    """opt: vLLM's optimization level (-O0: no torch.compile, no CUDA graphs: starts in seconds, for the tiny gate
    servers, where start-up, not speed, is the cost; None: vLLM's default, -O2, for the speed servers)."""
    a = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model), "--served-model-name", name,
         "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-model-len", str(max_len),
         # explicit KV bytes: no memory profiling, so servers can start side by side on one GPU
         "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(int(kv_gib * GiB)),
         "--max-num-seqs", "128", "--seed", "0"]
    if spec:
        a += ["--speculative-config", json.dumps(spec)]
    if opt is not None:
        a += ["--optimization-level", str(opt)]
    return a


def sb_argv(model: Path, name: str, port: int, spec: str, k: int | None, pages: int, extra: tuple[str, ...] = ()
            ) -> list[str]:
    a = [sys.executable, "-m", "specbench", "serve", "--model", str(model), "--served-model-name", name,
         "--port", str(port), "--device", "cuda", "--dtype", "bfloat16", "--spec", spec, "--num-pages", str(pages),
         "--max-model-len", "4096", "--max-pending", "1024"]
    if k:
        a += ["--k", str(k)]
    return a + list(extra)


SB_TAU = os.environ.get("VLLM_SB_TAU", "6.5")  # the bundled DFlash arm's synthetic acceptance (sb-4b-dflash)
GATE_OPT = int(os.environ.get("VLLM_GATE_OPT", "0"))  # the tiny gate servers' -O level (docs/vllm.md)
NGRAM_K, NGRAM_MIN, NGRAM_MAX = 4, 1, 4  # the bundled engine's n-gram defaults (engine/config.py SpecConfig)


def servers() -> dict[str, dict]:
    t, t12 = FIX / "tiny", FIX / "tiny-l12"
    ng = {"method": "ngram", "num_speculative_tokens": NGRAM_K, "prompt_lookup_min": NGRAM_MIN,
          "prompt_lookup_max": NGRAM_MAX}
    return {
        "vllm-tiny-off": dict(kind="vllm", port=8101, argv=vllm_argv(t / "target", "tiny", 8101, 1536, 2, None, opt=GATE_OPT)),
        "vllm-tiny-l12": dict(kind="vllm", port=8102, argv=vllm_argv(t / "target", "tiny", 8102, 1536, 2, {
            "method": "dflash", "model": str(t12 / "draft"), "num_speculative_tokens": 7}, opt=GATE_OPT)),
        "vllm-tiny-l13": dict(kind="vllm", port=8107, argv=vllm_argv(t / "target", "tiny", 8107, 1536, 2, {
            "method": "dflash", "model": str(t / "draft"), "num_speculative_tokens": 7}, opt=GATE_OPT)),
        "vllm-tiny-ngram": dict(kind="vllm", port=8108, argv=vllm_argv(t / "target", "tiny", 8108, 1536, 2, ng, opt=GATE_OPT)),
        "vllm-4b-off": dict(kind="vllm", port=8103, argv=vllm_argv(PAIR4B / "target", "q3", 8103, 4096, 14, None)),
        "vllm-4b-ngram": dict(kind="vllm", port=8104, argv=vllm_argv(PAIR4B / "target", "q3", 8104, 4096, 14, ng)),
        "sb-4b-off": dict(kind="sb", port=8105, argv=sb_argv(PAIR4B / "target", "q3", 8105, "off", None, 5000)),
        "sb-4b-ngram": dict(kind="sb", port=8106, argv=sb_argv(PAIR4B / "target", "q3", 8106, "ngram", NGRAM_K, 5000)),
        # DFlash at the synthetic tau (issue 28 item 4): vLLM's DFlash accepts nothing from the random drafter, so
        # this arm has no vLLM twin; it shows what the bundled engine's speculation does beside vLLM's spec off
        "sb-4b-dflash": dict(kind="sb", port=8109, argv=sb_argv(PAIR4B / "target", "q3", 8109, "dflash", None, 5000, (
            "--draft", str(PAIR4B / "draft"), "--synthetic-tau", SB_TAU))),
    }


def load_state() -> dict:
    try:
        return json.loads(STATE.read_text())
    except (OSError, ValueError):
        return {}


def save_state(st: dict) -> None:
    STATE.parent.mkdir(parents=True, exist_ok=True)
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(st, indent=1, default=str))
    tmp.replace(STATE)


_state_lock = threading.Lock()


def update_state(name: str, **kw) -> None:
    with _state_lock:
        st = load_state()
        st.setdefault(name, {}).update(kw)
        save_state(st)



def healthy(port: int) -> bool:
    """Ready, not just up: vLLM answers /health only once its engine is up, `specbench serve` answers 503
    "starting" until its warm-up is done (docs/server.md), so 200 means ready on both."""
    return http(f"http://127.0.0.1:{port}/health", timeout=3)[0] == 200


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False


def start(name: str, logs: Path) -> None:
    spec = servers()[name]
    st = load_state().get(name, {})
    if alive(st.get("pid")) and healthy(spec["port"]):
        log(f"{name}: reusing pid {st['pid']} on :{spec['port']}")
        update_state(name, reused=True)
        return
    logs.mkdir(parents=True, exist_ok=True)
    fh = open(logs / f"{name}.log", "ab")
    p = subprocess.Popen(spec["argv"], env=env_for(spec["kind"]), stdout=fh, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(ROOT))
    update_state(name, pid=p.pid, port=spec["port"], kind=spec["kind"], argv=spec["argv"], t_launch=time.time(),
                 t_healthy=None, reused=False, log=str(logs / f"{name}.log"))
    log(f"{name}: launched pid {p.pid} on :{spec['port']}: {shlex.join(spec['argv'][1:])}")


def wait(names: list[str], timeout: float) -> dict[str, bool]:
    end = time.time() + timeout
    ok: dict[str, bool] = {}
    while time.time() < end and len(ok) < len(names):
        st = load_state()
        for n in names:
            if n in ok:
                continue
            s = st.get(n, {})
            code, body = http(f"http://127.0.0.1:{s.get('port', 0)}/health", timeout=3)
            if code and s.get("t_answer") is None and s.get("t_launch"):  # up (maybe still warming up)
                update_state(n, t_answer=time.time(), answer_s=round(time.time() - s["t_launch"], 1))
            if code == 200:
                ok[n] = True
                if s.get("t_healthy") is None:
                    dt = time.time() - s["t_launch"]
                    try:
                        w = (json.loads(body) or {}).get("warmup") if body.startswith("{") else None
                    except ValueError:
                        w = None
                    extra = {"warmup_s": w.get("seconds"), "warmup_state": w.get("state")} if isinstance(w, dict) else {}
                    update_state(n, t_healthy=time.time(), startup_s=round(dt, 1), **extra)
                    log(f"{n}: healthy (ready) after {dt:.0f}s" + (f", warm-up {extra['warmup_s']} s" if extra else ""))
            elif not alive(s.get("pid")):
                ok[n] = False
                log(f"{n}: DIED before healthy; log tail:\n" + tail(s.get("log"), 40))
        time.sleep(1.0)
    for n in names:
        if n not in ok:
            ok[n] = False
            log(f"{n}: not healthy within {timeout:.0f}s; log tail:\n" + tail(load_state().get(n, {}).get("log"), 30))
    return ok


def tail(path: str | None, n: int) -> str:
    if path is None:
        return ""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except (OSError, TypeError):
        return "(no log)"


def stop_all() -> None:
    st = load_state()
    for s in st.values():
        pid = s.get("pid")
        if alive(pid):
            try:
                os.killpg(pid, signal.SIGTERM)  # its own session: the API server and its engine core
            except OSError:
                pass
    time.sleep(5)
    for n, s in st.items():
        pid = s.get("pid")
        if alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        update_state(n, stopped_at=time.time())
    log("servers stopped")


def warm(name: str, prompt: str = "Question: what is 2 + 3?\nAnswer:", n: int = 1, max_tokens: int = 16) -> float:
    """One completion (n in parallel): the bundled engine compiles FlashInfer kernels on first use."""
    port = load_state()[name]["port"]
    t = time.time()
    ths = [threading.Thread(target=http, args=(f"http://127.0.0.1:{port}/v1/completions",
                                               {"model": "q3", "prompt": prompt + " " * i, "max_tokens": max_tokens,
                                                "temperature": 0}, 600)) for i in range(n)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return round(time.time() - t, 1)


LOG_KEYS = re.compile(r"(Model loading took|torch\.compile takes|Compiling a graph|Available KV cache memory|"
                      r"GPU KV cache size|Maximum concurrency|Graph capturing finished|init engine|"
                      r"Using .*[Aa]ttention|attention backend|FlashAttention|Loading drafter|speculative|"
                      r"aux|Starting vLLM|non-default args|memory: KV pool|Error|error|Traceback)")


def describe_servers(names: list[str]) -> dict:
    """Version, argv, start-up time, memory (per process session from nvidia-smi) and log excerpts."""
    st = load_state()
    mem_by_pid: dict[int, int] = {}
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20).stdout
        for line in q.strip().splitlines():
            pid_s, mib_s = (x.strip() for x in line.split(","))
            mem_by_pid[int(pid_s)] = int(mib_s)
    except Exception as e:  # noqa: BLE001
        log(f"nvidia-smi per-process memory unavailable: {e!r}")
    out = {}
    for n in names:
        s: dict[str, Any] = dict(st.get(n, {}))
        sess = s.get("pid")
        mib = 0
        for pid, m in mem_by_pid.items():
            try:
                if os.getsid(pid) == sess:
                    mib += m
            except OSError:
                pass
        s["gpu_mib"] = mib or None
        text = ""
        try:
            text = Path(s["log"]).read_text(errors="replace")
        except (OSError, KeyError):
            pass
        s["log_excerpt"] = [ln[-300:] for ln in text.splitlines() if LOG_KEYS.search(ln)][:60]
        out[n] = s
    return out


def versions() -> dict:
    v = {}
    for kind in ("vllm", "sb"):
        r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "stack_versions.py")], env=env_for(kind),
                           capture_output=True, text=True, timeout=120)
        try:
            v[kind] = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            v[kind] = {"error": (r.stderr or r.stdout)[-2000:]}
    try:
        v["commit"] = subprocess.run(["git", "log", "-1", "--format=%H %cI %s"], cwd=ROOT, capture_output=True,
                                     text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        v["commit"] = None
    try:
        v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        v["driver"] = repr(e)
    return v


# ---- suites ----------------------------------------------------------------------------------------------

def sb_cli(args: list[str], out: Path, tag: str, timeout: float, json_last: bool = True) -> dict:
    """Run `python -m specbench ARGS` with a timeout; keep stdout/stderr; parse the last JSON line."""
    timeout = max(10.0, min(timeout, left() - 15))
    cmd = [sys.executable, "-m", "specbench", *args]
    log(f"{tag}: specbench {shlex.join(args)} (timeout {timeout:.0f}s)")
    t = time.time()
    rc: int | str
    try:
        r = subprocess.run(cmd, env=env_for("sb"), capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
        rc, so, se = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:
        rc, so, se = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    wall = round(time.time() - t, 1)
    (out / f"{tag}.stdout").write_text(so or "")
    (out / f"{tag}.stderr").write_text(se or "")
    doc = None
    if json_last:
        for line in reversed((so or "").strip().splitlines()):
            if line.startswith("{"):
                try:
                    doc = json.loads(line)
                    break
                except ValueError:
                    pass
    if doc is not None:
        (out / f"{tag}.json").write_text(json.dumps(doc, indent=1, default=str))
    log(f"{tag}: rc={rc} in {wall}s" + ("" if rc == 0 else "\n" + "\n".join((se or so or "").splitlines()[-25:])))
    return {"tag": tag, "argv": args, "rc": rc, "wall_s": wall, "json": f"{tag}.json" if doc else None,
            "verdict": verdict_of(doc)}


def verdict_of(doc: dict | None):
    if not isinstance(doc, dict):
        return None
    for k in ("verdict", "status", "ok"):
        if k in doc:
            return doc[k]
    return None


def url(name: str) -> str:
    return f"openai:http://127.0.0.1:{servers()[name]['port']}/v1"


TINY = ["vllm-tiny-off", "vllm-tiny-l12", "vllm-tiny-l13", "vllm-tiny-ngram"]
BIG = ["vllm-4b-off", "vllm-4b-ngram"]
SB = ["sb-4b-off", "sb-4b-ngram", "sb-4b-dflash"]
# VLLM_SPEED_SERVERS: the speed part's servers, comma-separated (default all five: about 110 GB, an H200's size;
# on an H100 three fit, e.g. vllm-4b-off,sb-4b-off,sb-4b-dflash)
_SPEED = [t.strip() for t in os.environ.get("VLLM_SPEED_SERVERS", "").split(",") if t.strip()]
if _SPEED:
    _unknown = sorted(set(_SPEED) - set(BIG) - set(SB))
    if _unknown:
        sys.exit(f"VLLM_SPEED_SERVERS: unknown server(s) {_unknown}; accepted: {BIG + SB}")
    BIG = [n for n in BIG if n in _SPEED]
    SB = [n for n in SB if n in _SPEED]


# the tiny n-gram gates' prompts: 16 gsm8k questions x 128 greedy tokens; the trained tiny target repeats its own
# phrases ("The total number of ... is", the <<a*b=c>> calculations), so the lookup is accepted for real: the
# bundled engine's n-gram (K 4, n 1-4) accepts 2.03 tokens per step here (CPU fp32; 1.98 concurrent)
NG_TINY = ["--dataset", "gsm8k", "--num-prompts", "16", "--max-tokens", "128"]


def gate_jobs(out: Path) -> list[tuple[str, list[str], float, list[str]]]:
    """(tag, servers it needs, a timeout, specbench args), in priority order."""
    L = ["lossless", "--margin-tol", "0.20"]
    tng = ["vllm-tiny-off", "vllm-tiny-ngram"]
    return [
        ("lossless-tiny-l12", ["vllm-tiny-off", "vllm-tiny-l12"], 150, L + [
            "--baseline", url("vllm-tiny-off"), "--candidate", url("vllm-tiny-l12"), "--num-prompts", "16",
            "--max-tokens", "64", "--concurrent", "--engine-gates", "--json", "--no-record",
            "--report", str(out / "lossless-tiny-l12.md")]),
        ("lossless-4b-ngram", BIG, 150, L + [
            "--baseline", url("vllm-4b-off"), "--candidate", url("vllm-4b-ngram"), "--dataset", "humaneval",
            "--num-prompts", "16", "--max-tokens", "128", "--concurrent", "--json", "--no-record",
            "--report", str(out / "lossless-4b-ngram.md")]),
        ("lossless-tiny-ngram", tng, 90, L + [
            "--baseline", url("vllm-tiny-off"), "--candidate", url("vllm-tiny-ngram"), *NG_TINY, "--concurrent",
            "--json", "--no-record", "--report", str(out / "lossless-tiny-ngram.md")]),
        ("sampled-tiny-l12", ["vllm-tiny-off", "vllm-tiny-l12"], 200, [
            "sampled", "--baseline", url("vllm-tiny-off"), "--candidate", url("vllm-tiny-l12"), "--num-prompts", "4",
            "--samples", "256", "--null", "--json", "--no-record", "--report", str(out / "sampled-tiny-l12.md")]),
        ("lossless-tiny-l13", ["vllm-tiny-off", "vllm-tiny-l13"], 90, L + [
            "--baseline", url("vllm-tiny-off"), "--candidate", url("vllm-tiny-l13"), "--num-prompts", "16",
            "--max-tokens", "64", "--json", "--no-record", "--report", str(out / "lossless-tiny-l13.md")]),
        ("prefix-cache-vllm-4b-off", ["vllm-4b-off"], 120, ["q3"]),
        ("prefix-cache-vllm-tiny-off", ["vllm-tiny-off"], 60, ["tiny"]),
        ("sampled-tiny-ngram", tng, 200, [
            "sampled", "--baseline", url("vllm-tiny-off"), "--candidate", url("vllm-tiny-ngram"), "--num-prompts",
            "4", "--samples", "256", "--null", "--json", "--no-record", "--report", str(out / "sampled-tiny-ngram.md")]),
    ]


def run_gates(out: Path, record: list, reserve: float, defer: bool = False) -> None:
    """Every gate job whose output is not there yet, while more than `reserve` seconds are left. defer: a job
    whose servers are not healthy yet is left for a later pass, not recorded as skipped."""
    only = [t.strip() for t in os.environ.get("VLLM_GATES", "").split(",") if t.strip()]
    for tag, need, tmo, args in gate_jobs(out):
        if (out / f"{tag}.json").exists() or any(r.get("tag") == tag for r in record) or (only and tag not in only):
            continue
        if defer and not all(healthy(servers()[n]["port"]) for n in need):
            continue
        if left() - reserve < min(tmo, 60):
            record.append({"tag": tag, "skipped": f"deadline ({left():.0f}s left, {reserve:.0f}s reserved)"})
            log(f"{tag}: skipped (deadline)")
            continue
        if not all(healthy(servers()[n]["port"]) for n in need):
            record.append({"tag": tag, "skipped": f"servers not healthy: {need}"})
            log(f"{tag}: skipped (servers {need} not healthy)")
            continue
        if tag.startswith("prefix-cache-"):
            record.append(triage_prefix_cache(out, need[0], args[0]))
        else:
            record.append(sb_cli(args, out, tag, min(tmo, left() - reserve)))


def bring_up_sb(logs: Path) -> dict:
    """The bundled servers one after the other: each warms up before /health answers 200 (item 5 of the issue:
    ready means ready; the first compiles FlashInfer's kernels, the second finds them cached), then one
    completion and a burst of 64 are timed as the check that nothing is left to compile. Idempotent: a warmed,
    healthy server is kept."""
    warm_s = {}
    for n in SB:
        s = load_state().get(n, {})
        if s.get("warm") and alive(s.get("pid")) and healthy(servers()[n]["port"]):
            warm_s[n] = s["warm"]
            continue
        start(n, logs)
        if wait([n], min(240, max(10, left() - 60))).get(n):
            w = {"first_completion_s": warm(n), "burst64_s": warm(n, n=64, max_tokens=32)}
            w["ready_after_launch_s"] = round(time.time() - load_state()[n]["t_launch"], 1)
            update_state(n, warm=w)
            warm_s[n] = w
            log(f"{n}: warm-up {w}")
    return warm_s


def gates(out: Path, logs: Path, record: list) -> None:
    only = [t.strip() for t in os.environ.get("VLLM_GATES", "").split(",") if t.strip()]
    need = {n for tag, ns, _t, _a in gate_jobs(out) if not only or tag in only for n in ns}
    for n in TINY + BIG:
        if n in need or n in BIG:  # the 4B servers also serve the speed part
            start(n, logs)
    t = FIX / "tiny"
    side: list[dict] = []

    def cpu_ref() -> None:  # the bundled engine's acceptance on both tiny pairs and its n-gram, in process on CPU
        pair = ["--num-prompts", "16", "--max-tokens", "64"]
        for tag, spec, prompts in (("bundled-tiny-l13", f"draft={t / 'draft'}", pair),
                                   ("bundled-tiny-l12", f"draft={FIX / 'tiny-l12' / 'draft'}", pair),
                                   ("bundled-tiny-ngram", f"spec=ngram,k={NGRAM_K}", NG_TINY + ["--concurrent"])):
            if not (out / f"{tag}.json").exists():
                side.append(sb_cli(["lossless", "--candidate",
                                    f"local:{t / 'target'},{spec},device=cpu", *prompts, "--json", "--no-record",
                                    "--report", str(out / f"{tag}.md")], out, tag, 200))

    ths = [threading.Thread(target=cpu_ref), threading.Thread(target=lambda: side.append({"warm": bring_up_sb(logs)}))]
    for th in ths:
        th.start()
    up = wait([n for n in TINY if n in need], min(240, left() - 60))  # -O0: up in well under a minute; the 4B servers compile meanwhile
    run_gates(out, record, reserve=20, defer=True)
    up.update(wait(BIG, min(330, left() - 60)))
    record.append({"servers_up": up})
    run_gates(out, record, reserve=20)
    for th in ths:
        th.join(timeout=max(1, left() - 15))
    record.extend(side)


def triage_prefix_cache(out: Path, name: str, model: str) -> dict:
    """benchmarks/prefix_triage.py against one server: the same greedy requests cold with two salts, then a
    cache fill and a cache hit; a divergence of the hit that the two cold arms do not show is the prefix
    cache's, and its regret says whether it is a tie flip."""
    tag = f"prefix-cache-{name}"
    if left() < 40:
        return {"tag": tag, "skipped": "deadline"}
    port = servers()[name]["port"]
    t = time.time()
    rc: int | str
    try:
        r = subprocess.run([sys.executable, "-m", "specbench.benchmarks.prefix_triage", f"http://127.0.0.1:{port}/v1",
                            model], env=env_for("sb"),
                           capture_output=True, text=True, timeout=max(10, min(120, left() - 15)), cwd=str(ROOT))
        so, se, rc = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired:
        so, se, rc = "", "timeout", "timeout"
    (out / f"{tag}.stderr").write_text(se or "")
    doc = None
    for line in reversed((so or "").strip().splitlines()):
        if line.startswith("{"):
            doc = json.loads(line)
            break
    if doc:
        (out / f"{tag}.json").write_text(json.dumps(doc, indent=1))
        log(f"{tag}: diverging {doc['diverging']} of {doc['prompts']}, max regret {doc['max_regret']}")
    else:
        log(f"{tag}: rc={rc}\n{(se or '')[-2000:]}")
    return {"tag": tag, "rc": rc, "wall_s": round(time.time() - t, 1), "json": f"{tag}.json" if doc else None,
            "diverging": doc and doc["diverging"], "max_regret": doc and doc["max_regret"]}


def speed(out: Path, logs: Path, record: list) -> None:
    cm = os.environ.get("VLLM_CLIENT", "0")
    if cm in ("1", "only"):  # the client job first, on a GPU the bundled servers' warm-up does not share
        client(out, logs, record, reserve=0.0 if cm == "only" else
               float(os.environ.get("VLLM_SWEEP_MIN_S", "260")) + 120)
        if cm == "only":
            return
    big = BIG
    for n in big:
        start(n, logs)
    warm_s = bring_up_sb(logs)
    sweep_need = float(os.environ.get("VLLM_SWEEP_MIN_S", "260"))
    run_gates(out, record, reserve=sweep_need)  # what the gates call left undone, if the sweep keeps its time
    for n in TINY:  # idle, but out of the way of the timings
        s = load_state().get(n, {})
        if alive(s.get("pid")):
            try:
                os.killpg(s["pid"], signal.SIGTERM)
            except OSError:
                pass
    up = wait(big, min(300, left() - 60))
    up.update({n: healthy(servers()[n]["port"]) for n in SB})
    record.append({"speed_servers_up": up, "warm": warm_s})
    arms = [n for n in ("vllm-4b-off", "sb-4b-off", "vllm-4b-ngram", "sb-4b-ngram", "sb-4b-dflash") if up.get(n)]
    if len(arms) < 2:
        log(f"speed: too few servers up ({up})")
        return
    budget = left() - 60
    levels = os.environ.get("VLLM_SWEEP_LEVELS", "1,8,16,32,64")
    args = ["sweep", "--concurrency", levels, "--arms", ";".join(f"{url(a)},name={a}" for a in arms),
            "--labels", ",".join(arms), "--baseline", arms[0], "--dataset", os.environ.get("VLLM_SWEEP_DATASET", "spec_bench"),
            "--prompts-per-level", os.environ.get("VLLM_SWEEP_PPL", "2"), "--max-tokens",
            os.environ.get("VLLM_SWEEP_TOKENS", "128"), "--ignore-eos", "--rounds", os.environ.get("VLLM_SWEEP_ROUNDS", "3"),
            "--out", str(out / "sweep"), "--report", str(out / "sweep.md"), "--no-progress"]
    log(f"sweep: specbench {shlex.join(args)} (interrupted at {budget:.0f}s, records kept)")
    t = time.time()
    rc: int | str
    with open(out / "sweep.stdout", "w") as fo, open(out / "sweep.stderr", "w") as fe:
        p = subprocess.Popen([sys.executable, "-m", "specbench", *args], env=env_for("sb"), stdout=fo, stderr=fe,
                             cwd=str(ROOT))
        try:
            rc = p.wait(timeout=max(10, budget))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGINT)  # like Ctrl-C: the run is marked incomplete, every record kept
            try:
                rc = p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                rc = "killed"
    log(f"sweep: rc={rc} in {time.time() - t:.0f}s\n" + tail(str(out / "sweep.stdout"), 30) + "\n" +
        tail(str(out / "sweep.stderr"), 10))
    record.append({"tag": "sweep", "argv": args, "rc": rc, "wall_s": round(time.time() - t, 1)})
    try:
        record.append({"tag": "sweep-summary", **summarize_sweep(out / "sweep", out)})
    except Exception as e:  # noqa: BLE001 - the raw records came back anyway
        log(f"sweep summary failed: {e!r}")


# ---- client: specbench's client against vLLM's own on the same server (issue 28 item 3) ---------------

CLIENT_LEVELS = [int(x) for x in os.environ.get("VLLM_CLIENT_LEVELS", "1,8,32").split(",") if x.strip()]
CLIENT_ROUNDS = int(os.environ.get("VLLM_CLIENT_ROUNDS", "3"))
CLIENT_PPL = int(os.environ.get("VLLM_CLIENT_PPL", "4"))  # random job: max(8, K x C) prompts per cell, as the sweep
CLIENT_IN = int(os.environ.get("VLLM_CLIENT_INPUT_LEN", "128"))
CLIENT_OUT = int(os.environ.get("VLLM_CLIENT_OUTPUT_LEN", "128"))
CLIENT_ACCEPT_PROMPTS = int(os.environ.get("VLLM_CLIENT_ACCEPT_PROMPTS", "64"))  # tiny-l12 job, every level
CLIENT_STEP_S = 45.0  # what one bench or sweep call needs at least (interpreter start-up, tokenizer, warm-up)


def client_jobs() -> list[dict]:
    """The compared jobs: the 4B-shaped target with spec off on random prompts of fixed lengths (`vllm bench
    serve`'s random data set against the sweep's: same lengths, different tokens), and with VLLM_CLIENT_ACCEPT=1
    (the default) the tiny target + DFlash tapping layers 1, 2 (accepted length ~4 on vLLM) on the same gsm8k
    prompts in both clients (one JSONL file, vLLM's custom data set and the sweep's), for acceptance."""
    jobs = [dict(tag="client-4b-off", server="vllm-4b-off", model="q3", tokenizer=PAIR4B / "target", k=None,
                 dataset="random", input_len=CLIENT_IN, output_len=CLIENT_OUT)]
    if os.environ.get("VLLM_CLIENT_ACCEPT", "1") == "1":
        jobs.append(dict(tag="client-tiny-l12", server="vllm-tiny-l12", model="tiny", tokenizer=FIX / "tiny" / "target",
                         k=7, dataset="custom", source="gsm8k", prompts=CLIENT_ACCEPT_PROMPTS, output_len=CLIENT_OUT))
    return jobs


def cell_prompts(job: dict, level: int) -> int:
    """Prompts per cell, the same in both clients: the whole shared file (custom), else max(8, K x C)."""
    return job["prompts"] if job["dataset"] == "custom" else max(8, CLIENT_PPL * level)


def run_logged(cmd: list[str], env: dict, path: Path, timeout: float) -> tuple[int | str, float]:
    """Run cmd with stdout and stderr into path; (rc or "timeout", wall seconds)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t = time.time()
    with open(path, "w") as fh:
        fh.write("$ " + shlex.join(cmd) + "\n")
        fh.flush()
        try:
            rc: int | str = subprocess.run(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           timeout=max(10.0, timeout), cwd=str(ROOT)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, round(time.time() - t, 1)


def vllm_bench_flags(logs: Path) -> dict:
    """Which optional `vllm bench serve` flags this vLLM has (its --help, once): the custom data set's chat
    template switch is --custom-skip-chat-template in some releases and --skip-chat-template in others."""
    text = ""
    for h in ("--help", "--help=all"):  # the second where a release groups its help
        try:
            r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", h],
                               env=env_for("vllm"), capture_output=True, text=True,
                               timeout=max(10, min(120, left() - 30)), cwd=str(ROOT))
            text = r.stdout + r.stderr
        except subprocess.TimeoutExpired:
            text = ""
        if "--dataset-name" in text:
            break
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "vllm-bench-help.txt").write_text(text)
    skip = next((f for f in ("--custom-skip-chat-template", "--skip-chat-template") if f in text), None)
    return {"help_ok": "--dataset-name" in text, "skip_chat_template": skip,
            "disable_shuffle": "--disable-shuffle" in text, "save_detailed": "--save-detailed" in text}


def vllm_bench_argv(job: dict, level: int | str, prompts: int | str, rnd: int | str, rdir: Path,
                    flags: dict) -> list[str]:
    """`vllm bench serve` for one level and round, in vLLM's interpreter (str arguments: for the docs line)."""
    port = servers()[job["server"]]["port"]
    a = [sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "vllm",
         "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", job["model"],
         "--tokenizer", str(job["tokenizer"]), "--label", "vllm-bench", "--max-concurrency", str(level),
         "--num-prompts", str(prompts), "--num-warmups", str(level), "--seed", "0", "--ignore-eos",
         "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
         "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(rdir),
         "--result-filename", f"vllm-bench-c{level}-r{rnd}.json"]
    if job["dataset"] == "random":
        a += ["--dataset-name", "random", "--random-input-len", str(job["input_len"]), "--random-output-len",
              str(job["output_len"]), "--random-range-ratio", "0"]
    else:
        a += ["--dataset-name", "custom", "--dataset-path", str(job["path"]), "--custom-output-len", str(job["output_len"]),
              flags["skip_chat_template"]]
        if flags.get("disable_shuffle"):
            a.append("--disable-shuffle")
    return a


def sweep_argv(job: dict, rdir: Path, store: Path) -> list[str]:
    """One `specbench sweep` round over every level: one arm, no noise-floor copy, the cells' vLLM-format
    copies in rdir."""
    port = servers()[job["server"]]["port"]
    a = ["sweep", "--arms", f"openai:http://127.0.0.1:{port}/v1,name=specbench", "--labels", "specbench",
         "--concurrency", ",".join(str(c) for c in CLIENT_LEVELS), "--max-tokens", str(job["output_len"]), "--ignore-eos",
         "--temperature", "0", "--rounds", "1", "--warmup", "1", "--no-noise-floor", "--seed", "0",
         "--result-dir", str(rdir), "--out", str(store), "--no-progress"]
    if job["dataset"] == "random":
        a += ["--dataset", "random", "--random-input-len", str(job["input_len"]), "--prompts-per-level", str(CLIENT_PPL)]
    else:
        a += ["--dataset", "custom", "--dataset-path", str(job["path"]), "--num-prompts", str(job["prompts"])]
    return a


def sweep_files(rdir: Path) -> dict[int, Path]:
    """The sweep's vLLM-format copies in rdir by level (their max_concurrency)."""
    got: dict[int, Path] = {}
    for f in sorted(rdir.glob("*.json")) if rdir.is_dir() else []:
        try:
            mc = json.loads(f.read_text()).get("max_concurrency")
        except (OSError, ValueError):
            continue
        if mc is not None:
            got[int(mc)] = f
    return got


def import_vllm(files: list[Path], label: str, store: Path, log_path: Path) -> str | None:
    """`specbench import vllm-bench FILES --label L --out STORE`; the imported run's directory."""
    if not files:
        return None
    cmd = [sys.executable, "-m", "specbench", "import", "vllm-bench", *map(str, files), "--label", label, "--out",
           str(store)]
    rc, _ = run_logged(cmd, env_for("sb"), log_path, min(120, max(10, left() - 15)))
    m = re.search(r"imported \d+ file\(s\): (\S+)", log_path.read_text(errors="replace"))
    log(f"import vllm-bench --label {label}: rc={rc} -> {m.group(1) if m else None}")
    return m.group(1) if m else None


def client_job(job: dict, out: Path, reserve: float, flags: dict) -> dict:
    """R rounds; in each, `vllm bench serve` at every level, then one `specbench sweep` over the same levels
    (one round, no noise-floor copy) on the same server and workload; files already there are kept (a later
    call finishes the rounds). Then the imports, a side-by-side report and the comparison."""
    from specbench.suites.sweep.client_compare import round_metrics

    tag = job["tag"]
    d = out / "client" / tag
    vdir, store, jlogs = d / "vllm-bench", d / "results", d / "logs"
    vdir.mkdir(parents=True, exist_ok=True)
    rec: dict = {"tag": tag, "server": job["server"], "levels": CLIENT_LEVELS, "rounds": CLIENT_ROUNDS, "steps": []}
    if job["dataset"] == "custom":
        if not (flags.get("help_ok") and flags.get("skip_chat_template")):
            job = dict(job, dataset="random", input_len=CLIENT_IN)
            rec["note"] = ("vllm bench serve --help lists no custom data set chat-template switch: random prompts "
                           "instead of the shared gsm8k file (same lengths, different tokens)")
            log(f"{tag}: {rec['note']}")
        else:
            from specbench.suites.sweep.workload import load_texts

            texts, _ = load_texts(job["source"], job["prompts"], seed=0)
            job = dict(job, path=d / f"{job['source']}-{job['prompts']}.jsonl")
            job["path"].write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    rec["dataset"] = job["dataset"]
    vllm_env = env_for("vllm")
    fails = {"vllm": 0, "sweep": 0}  # two failures in a row on one side: that side is given up for this job

    def skipped(side: str, step: str) -> bool:
        """Records and says whether `step` of `side` is skipped: its side failed twice in a row, or the deadline."""
        why = "two failures in a row" if fails[side] >= 2 else \
            f"deadline ({left():.0f}s left)" if left() - reserve < CLIENT_STEP_S else None
        if why is not None:
            rec["steps"].append({"step": step, "skipped": why})
        return why is not None

    for rnd in range(CLIENT_ROUNDS):
        for lv in CLIENT_LEVELS:
            f = vdir / f"vllm-bench-c{lv}-r{rnd}.json"
            if f.exists():
                continue
            if skipped("vllm", f"vllm-bench c{lv} r{rnd}"):
                continue
            argv = vllm_bench_argv(job, lv, cell_prompts(job, lv), rnd, vdir, flags)
            log(f"{tag} r{rnd} c{lv}: vllm {shlex.join(argv[3:])}")
            rc, wall = run_logged(argv, vllm_env, jlogs / f"vllm-bench-c{lv}-r{rnd}.log", min(300, left() - reserve - 10))
            rec["steps"].append({"step": f"vllm-bench c{lv} r{rnd}", "argv": argv[1:], "rc": rc, "wall_s": wall,
                                 "file": f.exists()})
            fails["vllm"] = 0 if f.exists() else fails["vllm"] + 1
            log(f"{tag} r{rnd} c{lv}: vllm bench rc={rc} in {wall}s" +
                ("" if f.exists() else "\n" + tail(str(jlogs / f"vllm-bench-c{lv}-r{rnd}.log"), 20)))
        sdir = d / "specbench" / f"r{rnd}"
        if set(CLIENT_LEVELS) <= set(sweep_files(sdir)):
            continue
        if skipped("sweep", f"sweep r{rnd}"):
            continue
        args = sweep_argv(job, sdir, store)
        log(f"{tag} r{rnd}: specbench {shlex.join(args)}")
        rc, wall = run_logged([sys.executable, "-m", "specbench", *args], env_for("sb"), jlogs / f"sweep-r{rnd}.log",
                              min(400, left() - reserve - 10))
        got = sorted(sweep_files(sdir))
        rec["steps"].append({"step": f"sweep r{rnd}", "argv": args, "rc": rc, "wall_s": wall, "levels": got})
        fails["sweep"] = 0 if got else fails["sweep"] + 1
        log(f"{tag} r{rnd}: sweep rc={rc} in {wall}s\n" + tail(str(jlogs / f"sweep-r{rnd}.log"), 12))

    per: dict[str, dict[int, list]] = {"vllm": {}, "specbench": {}}
    vfiles: list[Path] = []
    sfiles: list[Path] = []
    for lv in CLIENT_LEVELS:
        for by_level in per.values():
            by_level[lv] = []
        for rnd in range(CLIENT_ROUNDS):
            for side, f in (("vllm", vdir / f"vllm-bench-c{lv}-r{rnd}.json"),
                            ("specbench", sweep_files(d / "specbench" / f"r{rnd}").get(lv))):
                m = None
                if f is not None and f.exists():
                    try:
                        m = round_metrics(json.loads(f.read_text()), str(f))
                        (vfiles if side == "vllm" else sfiles).append(f)
                    except (OSError, ValueError) as e:  # VllmFormatError is a ValueError
                        rec["steps"].append({"step": f"read {f.name}", "error": str(e)[:300]})
                per[side][lv].append(m)
    rec["imported"] = {"vllm-bench": import_vllm(vfiles, "vllm-bench", store, jlogs / "import-vllm.log"),
                       "specbench": import_vllm(sfiles, "specbench", store, jlogs / "import-specbench.log")}
    runs = [r for r in (rec["imported"]["specbench"], rec["imported"]["vllm-bench"]) if r]
    if len(runs) == 2 and left() > 20:
        rc, _ = run_logged([sys.executable, "-m", "specbench", "report", *runs, "--out", str(out / f"{tag}-report.md"),
                            "--no-plots"], env_for("sb"), jlogs / "report.log", min(120, left() - 15))
        rec["report"] = f"{tag}-report.md" if rc == 0 else None
    if job["dataset"] == "random":
        wl = (f"random, {job['input_len']} prompt tokens / {job['output_len']} output tokens (--ignore-eos, greedy), "
              f"max(8, {CLIENT_PPL} x C) prompts per cell: the same lengths in both clients, not the same tokens "
              "(vLLM: random token ids; specbench: random words cut to the length by the server's tokenizer)")
    else:
        wl = (f"the same {job['prompts']} {job['source']} prompts in both clients ({job['path'].name}: vLLM's custom "
              f"data set without chat template, the sweep's custom data set), {job['output_len']} output tokens "
              "(--ignore-eos, greedy), every prompt at every level")
    per_cell = str(job["prompts"]) if job["dataset"] == "custom" else f"max(8,{CLIENT_PPL}xC)"
    rec["job"] = {"tag": tag, "server": job["server"], "workload": wl, "k": job["k"], "per_round": per, "commands": [
        "# for R in rounds: for C in levels:",
        shlex.join(["vllm", "bench", "serve", *vllm_bench_argv(job, "C", per_cell, "R", vdir, flags)[5:]]),
        "# then, same round, every level:",
        shlex.join(["specbench", *sweep_argv(job, d / "specbench" / "rR", store)]),
        "# after the rounds:",
        f"specbench import vllm-bench {vdir}/vllm-bench-c*-r*.json --label vllm-bench --out {store}"]}
    return rec


def client(out: Path, logs: Path, record: list, reserve: float = 0.0) -> None:
    """The client job on every server of client_jobs(), then client-compare.json / .md over what finished."""
    from specbench.suites.sweep.client_compare import CONVENTIONS, compare_clients, render_markdown

    jobs = client_jobs()
    names = [j["server"] for j in jobs]
    for n in names:
        start(n, logs)
    flags: dict = {}
    if any(j["dataset"] == "custom" for j in jobs):  # while the servers start: vLLM imports on the CPU
        flags = vllm_bench_flags(logs)
        record.append({"vllm_bench_flags": flags})
        log(f"client: vllm bench serve flags {flags}")
    up = wait(names, min(330, max(10, left() - reserve - 60)))
    record.append({"client_servers_up": up})
    done = []
    for job in jobs:
        if not up.get(job["server"]):
            record.append({"tag": job["tag"], "skipped": f"server {job['server']} not healthy"})
            continue
        if left() - reserve < 2 * CLIENT_STEP_S:
            record.append({"tag": job["tag"], "skipped": f"deadline ({left():.0f}s left, {reserve:.0f}s reserved)"})
            continue
        rec = client_job(job, out, reserve, flags)
        done.append(rec.pop("job"))
        record.append(rec)
    if not done:
        return
    for j in done:
        j["comparison"] = compare_clients(j["per_round"]["vllm"], j["per_round"]["specbench"], k=j["k"])
    (out / "client-compare.json").write_text(json.dumps({"jobs": done, "conventions": CONVENTIONS}, indent=1,
                                                         default=str))
    (out / "client-compare.md").write_text(render_markdown(done))
    record.append({"tag": "client-compare", "json": "client-compare.json", "md": "client-compare.md",
                   "verdicts": {j["tag"]: j["comparison"]["verdicts"] for j in done}})
    log("client-compare: " + json.dumps({j["tag"]: j["comparison"]["verdicts"] for j in done}))


def median(xs: list) -> float | None:
    xs = sorted(xs)
    return None if not xs else (xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2)


def summarize_sweep(sweep_dir: Path, out: Path) -> dict:
    from specbench.suites.report import load_run_summary

    runs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    s = load_run_summary(runs[-1])
    rows = []
    for lv in s.levels:
        row: dict[str, Any] = {"level": lv, "noise": s.noise.get(lv)}
        for arm in [a["label"] for a in s.arms]:
            c = s.cells.get((arm, lv))
            if c is None:
                continue
            vals = [v for v in c.tok_s.values() if v is not None]
            row[arm] = {"tok_s_rounds": c.tok_s, "tok_s_median": median(vals),
                        "stats": c.stats, "acceptance": c.acceptance, "speedup_vs_baseline": s.speedups.get((arm, lv))}
        for a, b in (("sb-4b-off", "vllm-4b-off"), ("sb-4b-ngram", "vllm-4b-ngram"), ("sb-4b-dflash", "vllm-4b-off")):
            if a in row and b in row:
                ra, rb = row[a]["tok_s_rounds"], row[b]["tok_s_rounds"]
                per = [ra[k] / rb[k] for k in ra if k in rb and ra[k] and rb[k]]
                row[f"{a}/{b}"] = {"per_round": per, "median": median(per),
                                   "min": min(per) if per else None, "max": max(per) if per else None}
        rows.append(row)
    audit = audit_counts(s.audit)
    doc = {"run_id": s.run_id, "complete": s.complete, "baseline": s.baseline, "noise_arm": s.noise_arm,
           "arms": s.arms, "levels": rows, "meta": s.meta, "audit": audit}
    (out / "sweep-summary.json").write_text(json.dumps(doc, indent=1, default=str))
    log("sweep audit: " + json.dumps({k: audit[k] for k in ("verdict", "cells")}))
    return {"json": "sweep-summary.json", "complete": s.complete, "audit": audit}


def audit_counts(a: dict | None) -> dict:
    """The sweep's acceptance / metrics audit (suites/sweep/audit.py) counted: the verdict, the cells by verdict
    over every arm and per arm, and the first problems and unjudged cells, so a run's false FAILs are counted."""
    if not a:
        return {"verdict": None, "cells": {}, "arms": {}}
    arms, total = {}, {PASS: 0, FAIL: 0, CANNOT_TEST: 0}
    for x in a.get("arms") or []:
        cv = dict(x.get("cell_verdicts") or {})
        for v, n in cv.items():
            total[v] = total.get(v, 0) + n
        arms[x["arm"]] = {"verdict": x["verdict"], "cells": cv, "problems": x.get("problems", [])[:5],
                          "unattributed": x.get("unattributed", [])[:5]}
    return {"verdict": a.get("verdict"), "cells": total, "arms": arms, "missing": a.get("missing", [])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("gates", "speed", "client", "all"), default="all")
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop", action="store_true", help="stop every server at the end")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    record: list = []
    summary = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "part": a.part, "deadline_s": DEADLINE}
    def ver() -> None:  # two interpreters importing vLLM: beside the start-ups, not before them
        summary["versions"] = versions()
        log(f"versions: {json.dumps(summary['versions'])}")
    vt = threading.Thread(target=ver, daemon=True)
    vt.start()
    try:
        if a.part in ("gates", "all"):
            gates(out, logs, record)
        if a.part in ("speed", "all") and left() > 120:
            speed(out, logs, record)
        if a.part == "client":
            client(out, logs, record)
    finally:
        vt.join(timeout=30)
        summary["runs"] = record
        summary["servers"] = describe_servers(list(servers()))
        if a.stop:
            stop_all()
        summary["wall_s"] = round(time.time() - T0, 1)
        (out / f"summary-{a.part}.json").write_text(json.dumps(summary, indent=1, default=str))
        log(f"summary: {out / f'summary-{a.part}.json'}")


if __name__ == "__main__":
    main()
