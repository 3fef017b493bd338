"""The results store: typed run and request records, appended as JSONL as they are produced.

Layout: <results>/<run-id>/run.json (one `RunRecord`, rewritten atomically on every status change),
<results>/<run-id>/requests.jsonl (one `RequestRecord` per line), and any other <kind>.jsonl a suite
writes with `Run.write(kind, record)`. <results> is the argument, else $SPECBENCH_RESULTS, else
./results.

Contract:
- Every record is one JSON line, written and flushed before `write` returns, so a killed run keeps
  every record it finished; readers skip a torn last line.
- `open_run(...)` is a context manager: status "running" inside, "complete" on a clean exit,
  "incomplete" (with the error) on any exception, KeyboardInterrupt/SIGINT or SIGTERM, which are then
  re-raised. A run whose process died without either is reported by `list_runs` as "incomplete"
  (stale) when its pid is gone on this host.
- Provenance (git sha and dirtiness, package versions, device, host, argv, timestamps) is captured at
  open; the suite supplies suite name + version, engine descriptions per arm, sampling, dataset, seeds.
- Times in a RequestRecord are seconds relative to its own t_send (perf_counter origins are
  arbitrary); `wall_send` is absolute (time.time()).
- Secrets: every record line has the run's `secrets` (open_run(secrets=...)) masked (`redact.scrub`:
  exact strings, so no recorded output text is touched); run.json and side files (`write_text`), which
  hold configuration, argv and error texts but no generated text, also pass `redact.redact_text`
  (`api_key=`, `--api-key`, Authorization / Bearer tokens). API keys never reach the store.
- References: <results>/references/<kind>/<key>.json, one JSON object per key, written atomically by
  `write_reference` and read by `read_reference` (None when absent or unreadable): measured values a later
  run is held against (the lossless gate's acceptance, keyed by an engine / drafter / prompts / max_tokens
  fingerprint). A reference is replaced only by an explicit write; `list_runs` never sees the folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specbench import env

from .interrupts import sigterm_as_sigint, terminated
from .provenance import provenance
from .redact import redact_text, scrub

if TYPE_CHECKING:
    import pandas as pd

    from .adapters.base import GenResult

ENV = "SPECBENCH_RESULTS"


def results_dir(override: str | Path | None = None) -> Path:
    return Path(override or env.get(ENV) or Path.cwd() / "results")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


@dataclass
class RequestRecord:
    run_id: str
    arm: str
    idx: int
    rid: str
    ok: bool
    error: str | None = None
    item_id: str | None = None
    round: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str | None = None
    text: str | None = None
    output_ids: list[int] | None = None
    wall_send: float = 0.0
    ttft: float | None = None
    e2el: float | None = None
    tpot: float | None = None
    chunk_offsets: list[float] = field(default_factory=list)  # chunk arrival - t_send
    chunk_tokens: list[int] = field(default_factory=list)
    token_count_method: str | None = None
    attempts: int = 1
    spec: dict | None = None
    logprobs: list[dict] | None = None
    meta: dict = field(default_factory=dict)

    @classmethod
    def from_result(cls, res: GenResult, run_id: str, arm: str, idx: int, item_id: str | None = None,
                    round: int | None = None, keep_text: bool = True, keep_logprobs: bool = False) -> RequestRecord:
        lps = None
        if keep_logprobs and res.logprobs is not None:
            lps = [{"token_id": p.token_id, "logprob": p.logprob, "top": {str(k): v for k, v in p.top.items()}}
                   for p in res.logprobs]
        return cls(run_id=run_id, arm=arm, idx=idx, rid=res.rid, ok=res.ok, error=res.error, item_id=item_id,
                   round=round, prompt_tokens=res.prompt_tokens, completion_tokens=res.completion_tokens,
                   finish_reason=res.finish_reason, text=res.text if keep_text else None,
                   output_ids=res.output_ids, wall_send=res.wall_send, ttft=res.ttft, e2el=res.e2el, tpot=res.tpot,
                   chunk_offsets=[t - res.t_send for t in res.chunk_times], chunk_tokens=list(res.chunk_tokens),
                   token_count_method=res.token_count_method, attempts=res.attempts, spec=res.spec, logprobs=lps,
                   meta=dict(res.meta))


@dataclass
class RunRecord:
    run_id: str
    suite: str
    suite_version: str
    status: str = "running"
    started: str = field(default_factory=_now)
    ended: str | None = None
    engines: dict[str, dict] = field(default_factory=dict)  # arm -> adapter.describe()
    sampling: dict = field(default_factory=dict)
    dataset: dict = field(default_factory=dict)
    seeds: Any = None
    config: dict = field(default_factory=dict)
    provenance: dict = field(default_factory=dict)
    error: str | None = None
    summary: dict = field(default_factory=dict)


def _json(obj: Any) -> str:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = asdict(obj)
    return json.dumps(obj, ensure_ascii=False, default=str, allow_nan=True)


class Run:
    """An open run: append records, update the run record. Thread-safe."""

    def __init__(self, path: Path, record: RunRecord, secrets: tuple[str, ...] = ()) -> None:
        self.path, self.record = path, record
        self.secrets = tuple(s for s in secrets if s)  # masked in every line written (harness/redact.py)
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    @property
    def run_id(self) -> str:
        return self.record.run_id

    def _save(self) -> None:
        tmp = self.path / "run.json.tmp"
        tmp.write_text(redact_text(json.dumps(asdict(self.record), indent=2, default=str), self.secrets) + "\n")
        os.replace(tmp, self.path / "run.json")

    def write(self, kind: str, record: Any) -> None:
        if not kind.replace("_", "").isalnum():
            raise ValueError(f"kind={kind!r} is invalid: expected a plain name such as 'requests'")
        line = scrub(_json(record), self.secrets) + "\n"  # exact keys only: record text stays as generated
        with self._lock:
            fh = self._files.get(kind)
            if fh is None:
                fh = self._files[kind] = open(self.path / f"{kind}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
            fh.write(line)
            fh.flush()
            self.counts[kind] = self.counts.get(kind, 0) + 1

    def write_text(self, path: str | Path, text: str) -> Path:
        """A side file of the run (another tool's format, a copy elsewhere), written whole and atomically,
        with the run's secrets masked like every record."""
        p = Path(path)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(redact_text(text, self.secrets), encoding="utf-8")
        os.replace(tmp, p)
        return p

    def add_request(self, rec: RequestRecord) -> None:
        self.write("requests", rec)

    def add_result(self, res: GenResult, arm: str, idx: int, **kw: Any) -> RequestRecord:
        rec = RequestRecord.from_result(res, self.run_id, arm, idx, **kw)
        self.add_request(rec)
        return rec

    def update(self, **fields: Any) -> None:
        with self._lock:
            for k, v in fields.items():
                if not hasattr(self.record, k):
                    raise AttributeError(f"RunRecord has no field {k!r}")
                setattr(self.record, k, v)
            self._save()

    def finish(self, status: str, error: str | None = None) -> None:
        with self._lock:
            for fh in self._files.values():
                fh.close()
            self._files.clear()
            self.record.status, self.record.error, self.record.ended = status, error, _now()
            self.record.provenance.setdefault("counts", {}).update(self.counts)
            self._save()


def new_run_id(suite: str) -> str:
    return f"{suite}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


@contextlib.contextmanager
def open_run(suite: str, suite_version: str = "1", engines: dict[str, dict] | None = None,
             sampling: dict | None = None, dataset: dict | None = None, seeds: Any = None,
             config: dict | None = None, results: str | Path | None = None, run_id: str | None = None,
             secrets: tuple[str, ...] | list[str] = ()) -> Iterator[Run]:
    run_id = run_id or new_run_id(suite)
    path = results_dir(results) / run_id
    path.mkdir(parents=True, exist_ok=False)
    rec = RunRecord(run_id=run_id, suite=suite, suite_version=str(suite_version), engines=dict(engines or {}),
                    sampling=dict(sampling or {}), dataset=dict(dataset or {}), seeds=seeds, config=dict(config or {}),
                    provenance=provenance())
    run = Run(path, rec, tuple(secrets))
    run._save()
    try:
        with sigterm_as_sigint():  # SIGTERM unwinds as Ctrl-C does (harness/interrupts.py)
            yield run
    except BaseException as e:
        kind = "interrupted" if isinstance(e, KeyboardInterrupt) else type(e).__name__
        if kind == "interrupted" and terminated():
            kind = "interrupted (SIGTERM)"
        run.finish("incomplete", f"{kind}: {e}".rstrip(": "))
        raise
    else:
        run.finish("complete")


# ---- references ----------------------------------------------------------------------------------
REFERENCES = "references"


def reference_file(kind: str, key: str, results: str | Path | None = None) -> Path:
    for part, what in ((kind, "kind"), (key, "key")):
        if not part or not part.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{what}={part!r} is invalid: expected a plain name (letters, digits, - and _)")
    return results_dir(results) / REFERENCES / kind / f"{key}.json"


def read_reference(kind: str, key: str, results: str | Path | None = None) -> dict | None:
    f = reference_file(kind, key, results)
    try:
        d = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(d, dict):
        return None
    d.setdefault("path", str(f))
    return d


def write_reference(kind: str, key: str, record: dict, results: str | Path | None = None) -> Path:
    f = reference_file(kind, key, results)
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**record, "recorded": record.get("recorded") or _now()}, indent=2, default=str) + "\n",
                   encoding="utf-8")
    os.replace(tmp, f)
    return f


# ---- readers -------------------------------------------------------------------------------------
def read_jsonl(path: str | Path) -> list[dict]:
    """All complete records of a JSONL file; a torn final line (a killed writer) is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def effective_status(meta: dict) -> str:
    st = meta.get("status", "unknown")
    prov = meta.get("provenance") or {}
    if st == "running" and prov.get("host") == socket.gethostname() and isinstance(prov.get("pid"), int) \
            and not _pid_alive(prov["pid"]):
        return "incomplete"
    return st


@dataclass
class LoadedRun:
    path: Path
    meta: dict

    @property
    def run_id(self) -> str:
        return self.meta.get("run_id", self.path.name)

    @property
    def status(self) -> str:
        return effective_status(self.meta)

    def records(self, kind: str = "requests") -> list[dict]:
        return read_jsonl(self.path / f"{kind}.jsonl")

    def frame(self, kind: str = "requests") -> pd.DataFrame:
        from specbench.extras import need

        pd = need("pandas", "frames", "LoadedRun.frame")

        rows = self.records(kind)
        df = pd.json_normalize(rows, max_level=1) if rows else pd.DataFrame()
        return df

    @property
    def requests(self) -> pd.DataFrame:
        return self.frame("requests")

    def kinds(self) -> list[str]:
        return sorted(p.stem for p in self.path.glob("*.jsonl"))


def load_stored_run(run: str | Path, results: str | Path | None = None) -> LoadedRun:
    p = Path(run)
    if not (p / "run.json").is_file():
        p = results_dir(results) / str(run)
    f = p / "run.json"
    if not f.is_file():
        raise FileNotFoundError(f"no run at {p}: expected {f}")
    return LoadedRun(p, json.loads(f.read_text()))


def list_runs(results: str | Path | None = None, suite: str | None = None) -> pd.DataFrame:
    """One row per run under the results dir, newest first."""
    from specbench.extras import need

    pd = need("pandas", "frames", "list_runs")

    rows = []
    root = results_dir(results)
    for f in sorted(root.glob("*/run.json")) if root.is_dir() else []:
        try:
            meta = json.loads(f.read_text())
        except (json.JSONDecodeError, OSError):
            continue
        if suite and meta.get("suite") != suite:
            continue
        n = sum(1 for _ in open(f.parent / "requests.jsonl", encoding="utf-8")) \
            if (f.parent / "requests.jsonl").is_file() else 0
        rows.append({"run_id": meta.get("run_id", f.parent.name), "suite": meta.get("suite"),
                     "suite_version": meta.get("suite_version"), "status": effective_status(meta),
                     "started": meta.get("started"), "ended": meta.get("ended"), "requests": n,
                     "arms": ",".join(meta.get("engines") or {}), "path": str(f.parent)})
    cols = ["run_id", "suite", "suite_version", "status", "started", "ended", "requests", "arms", "path"]
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values("started", ascending=False, ignore_index=True) if len(df) else df
