"""Reader for Nsight Systems SQLite exports (`nsys export --type sqlite`), every schema generation seen.

Contract:
- Busy intervals come from CUPTI_ACTIVITY_KIND_KERNEL, _MEMCPY and _MEMSET (whichever exist; a table
  exists only when that kind of event was recorded). CUPTI_ACTIVITY_KIND_SYNCHRONIZATION rows are
  never busy and are not read.
- Schema differences are handled by looking at columns, not versions: kernel names come from
  demangledName, else shortName, else mangledName, each an id into StringIds (or the text itself);
  greenContextId / graphId / globalPid may be missing. Metadata lives in META_DATA_EXPORT +
  META_DATA_CAPTURE (2024+) or EXPORT_META_DATA (older).
- CUDA graphs. Node mode (`--cuda-graph-trace=node`): graph kernels are ordinary kernel rows (with a
  graphNodeId) and each is attributed. Graph mode (the default): a replay is one
  CUPTI_ACTIVITY_KIND_GRAPH_TRACE row and its kernels are absent; each such row counts as busy as one
  opaque "CUDA graph" activity (classified "CUDA graph (opaque)"), and a note says per-kernel
  attribution inside graphs needs node mode. A graph-mode export that has graph launches with no
  kernels and no GRAPH_TRACE table would make busy time wrong, so it is refused (GapsError).
- Phases (optional): NVTX push/pop and start/end ranges (NVTX_EVENTS), matched to each activity via
  its launch call in CUPTI_ACTIVITY_KIND_RUNTIME (same correlationId and process), on the launching
  thread; see ranges.py for the innermost/outermost rule.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

from .ranges import Range, RangeIndex
from .trace import Activity, GapsError, Trace

_ACTIVITY_TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
                    "CUPTI_ACTIVITY_KIND_GRAPH_TRACE")
_MEMCPY_KINDS = {0: "Unknown", 1: "Host-to-Device", 2: "Device-to-Host", 3: "Host-to-Array", 4: "Array-to-Host",
                 5: "Array-to-Array", 6: "Array-to-Device", 7: "Device-to-Array", 8: "Device-to-Device",
                 9: "Host-to-Host", 10: "Peer-to-Peer"}
_NVTX_RANGE_TYPES = (59, 60, 70, 71)  # Nvtx(t)PushPopRange, Nvtx(t)StartEndRange
_PID_MASK = ~0xFFFFFF  # globalTid = globalPid | tid (low 24 bits)


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _meta(db: sqlite3.Connection, tables: set[str]) -> dict[str, str]:
    meta: dict[str, str] = {}
    for table in ("EXPORT_META_DATA", "META_DATA_EXPORT", "META_DATA_CAPTURE"):
        if table in tables:
            for row in db.execute(f"SELECT * FROM {table}"):
                if len(row) >= 2 and row[0] is not None and not str(row[0]).startswith("PROCESS_"):
                    meta.setdefault(str(row[0]), str(row[1]))
    return meta


def _connect(path: Path) -> sqlite3.Connection:
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        db.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.DatabaseError as e:
        raise GapsError(f"{path}: not a readable SQLite database ({e})") from e
    return db


def read_nsys_sqlite(path: Path, phases: bool = False, pick: str = "innermost",
                     name_filter: re.Pattern[str] | None = None) -> Trace:
    db = _connect(path)
    try:
        return _read(db, path, phases, pick, name_filter)
    except sqlite3.DatabaseError as e:
        raise GapsError(f"{path}: unexpected nsys schema ({e})") from e
    finally:
        db.close()


def _read(db: sqlite3.Connection, path: Path, phases: bool, pick: str,
          name_filter: re.Pattern[str] | None) -> Trace:
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if not tables & set(_ACTIVITY_TABLES):
        raise GapsError(f"{path}: an SQLite file without CUPTI kernel/memcpy/memset tables; expected an nsys "
                        "export of a run traced with `--trace=cuda`")
    strings: dict[int, str] = {}
    if "StringIds" in tables:
        strings = dict(db.execute("SELECT id, value FROM StringIds"))

    def text(v: object) -> str:
        if isinstance(v, int):
            return strings.get(v, f"<string {v}>")
        return "" if v is None else str(v)

    meta = _meta(db, tables)
    notes: list[str] = []
    acts: list[Activity] = []
    keys: list[tuple[int | None, int | None]] = []  # (globalPid, correlationId) per activity
    inverted = 0

    def add(start: int, end: int, dev: object, stream: object, kind: str, name: str, pid: object,
            corr: object) -> None:
        nonlocal inverted
        if end < start:
            inverted += 1
            end = start
        acts.append(Activity(int(start), int(end), str(dev), str(stream), kind, name))
        keys.append((pid if isinstance(pid, int) else None, corr if isinstance(corr, int) else None))

    kernel_corr: set[tuple[int | None, int | None]] = set()
    n_graph_kernels = 0
    if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
        cols = _columns(db, "CUPTI_ACTIVITY_KIND_KERNEL")
        name_cols = [c for c in ("demangledName", "shortName", "mangledName") if c in cols]
        if not name_cols:
            raise GapsError(f"{path}: kernel table has no name column (demangledName/shortName/mangledName)")
        pid = "globalPid" if "globalPid" in cols else "NULL"
        node = "graphNodeId" if "graphNodeId" in cols else "NULL"
        sql = (f"SELECT start, end, deviceId, streamId, {pid}, correlationId, {node}, {', '.join(name_cols)} "
               "FROM CUPTI_ACTIVITY_KIND_KERNEL")
        for start, end, dev, stream, gpid, corr, node_id, *names in db.execute(sql):
            name = next((text(n) for n in names if n is not None), "<unnamed kernel>")
            add(start, end, dev, stream, "kernel", name, gpid, corr)
            kernel_corr.add(keys[-1])
            n_graph_kernels += node_id is not None
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        labels = dict(_MEMCPY_KINDS)
        if "ENUM_CUDA_MEMCPY_OPER" in tables and "label" in _columns(db, "ENUM_CUDA_MEMCPY_OPER"):
            labels.update(db.execute("SELECT id, label FROM ENUM_CUDA_MEMCPY_OPER"))
        cols = _columns(db, "CUPTI_ACTIVITY_KIND_MEMCPY")
        pid = "globalPid" if "globalPid" in cols else "NULL"
        kind = "copyKind" if "copyKind" in cols else "NULL"
        sql = f"SELECT start, end, deviceId, streamId, {pid}, correlationId, {kind} FROM CUPTI_ACTIVITY_KIND_MEMCPY"
        for start, end, dev, stream, gpid, corr, ck in db.execute(sql):
            add(start, end, dev, stream, "memcpy", f"memcpy {labels.get(ck, 'Unknown')}", gpid, corr)
    if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
        pid = "globalPid" if "globalPid" in _columns(db, "CUPTI_ACTIVITY_KIND_MEMSET") else "NULL"
        sql = f"SELECT start, end, deviceId, streamId, {pid}, correlationId FROM CUPTI_ACTIVITY_KIND_MEMSET"
        for start, end, dev, stream, gpid, corr in db.execute(sql):
            add(start, end, dev, stream, "memset", "memset", gpid, corr)

    launches = _graph_launches(db, tables, strings)
    missing = {k for k in launches if k not in kernel_corr}
    if "CUPTI_ACTIVITY_KIND_GRAPH_TRACE" in tables:
        cols = _columns(db, "CUPTI_ACTIVITY_KIND_GRAPH_TRACE")
        pid = "globalPid" if "globalPid" in cols else "NULL"
        gid = "graphId" if "graphId" in cols else "NULL"
        n_opaque = 0
        sql = f"SELECT start, end, deviceId, streamId, {pid}, correlationId, {gid} FROM CUPTI_ACTIVITY_KIND_GRAPH_TRACE"
        for start, end, dev, stream, gpid, corr, graph_id in db.execute(sql):
            key = (gpid if isinstance(gpid, int) else None, corr)
            if key in kernel_corr:
                continue  # node-mode kernels of this replay are already there
            add(start, end, dev, stream, "graph", f"CUDA graph {graph_id} replay", gpid, corr)
            missing.discard(key)
            n_opaque += 1
        if n_opaque:
            notes.append(f"graph-mode export: {n_opaque} CUDA graph replays count as busy as a whole and their idle "
                         "share is attributed to class 'CUDA graph (opaque)'; re-record with "
                         "`nsys profile --cuda-graph-trace=node` to attribute the kernels inside graphs")
    if missing:
        if "CUPTI_ACTIVITY_KIND_GRAPH_TRACE" not in tables:
            raise GapsError(
                f"{path}: {len(missing)} CUDA graph launches have no kernels in this export and there is no "
                "CUPTI_ACTIVITY_KIND_GRAPH_TRACE table, so busy time cannot be computed (graph-mode export). "
                "Re-record with `nsys profile --cuda-graph-trace=node` (or export the graph trace)")
        notes.append(f"{len(missing)} CUDA graph launches have neither kernels nor a graph-trace row "
                     "(outside the captured window?); they are not counted")
    if n_graph_kernels:
        notes.append(f"node-mode CUDA graph trace: {n_graph_kernels} kernels launched from graphs are attributed "
                     "one by one")
    if inverted:
        notes.append(f"{inverted} rows had end < start and were clamped to zero length")
    if not acts:
        raise GapsError(f"{path}: the export has activity tables but no kernel, memcpy or memset rows")

    has_ranges = False
    if phases:
        has_ranges = _assign_phases(db, tables, strings, acts, keys, pick, name_filter, notes)
    version = meta.get("EXPORT_SCHEMA_VERSION", "unknown")
    meta = {k: v for k, v in meta.items() if k.startswith(("EXPORT_PRODUCT_VERSION", "EXPORT_SCHEMA_VERSION",
                                                          "CUDA_GRAPH_TRACE_OPTIONS"))}
    meta.setdefault("EXPORT_SCHEMA_VERSION", version)
    return Trace(path, "nsys-sqlite", acts, resolution_ns=1, notes=notes, meta=meta, has_ranges=has_ranges)


def _graph_launches(db: sqlite3.Connection, tables: set[str], strings: dict[int, str]) -> set[tuple]:
    """(globalPid, correlationId) of every cudaGraphLaunch / cuGraphLaunch call."""
    if "CUPTI_ACTIVITY_KIND_RUNTIME" not in tables:
        return set()
    cols = _columns(db, "CUPTI_ACTIVITY_KIND_RUNTIME")
    if "nameId" not in cols:
        return set()
    ids = [i for i, s in strings.items() if s.startswith(("cudaGraphLaunch", "cuGraphLaunch"))]
    if not ids:
        return set()
    tid = "globalTid" if "globalTid" in cols else "NULL"
    marks = ",".join("?" * len(ids))
    rows = db.execute(f"SELECT {tid}, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE nameId IN ({marks})", ids)
    return {((t & _PID_MASK) if isinstance(t, int) else None, c) for t, c in rows}


def _assign_phases(db: sqlite3.Connection, tables: set[str], strings: dict[int, str], acts: list[Activity],
                   keys: list[tuple], pick: str, name_filter: re.Pattern[str] | None, notes: list[str]) -> bool:
    if "NVTX_EVENTS" not in tables:
        notes.append("no NVTX_EVENTS table: every activity is in phase '(none)'")
        return False
    cols = _columns(db, "NVTX_EVENTS")
    text_id = "textId" if "textId" in cols else "NULL"
    marks = ",".join(str(t) for t in _NVTX_RANGE_TYPES)
    sql = (f"SELECT globalTid, start, end, text, {text_id} FROM NVTX_EVENTS "
           f"WHERE eventType IN ({marks}) AND end IS NOT NULL")
    ranges = []
    for tid, start, end, txt, tid_text in db.execute(sql):
        name = txt if txt is not None else strings.get(tid_text, "") if tid_text is not None else ""
        ranges.append((tid, Range(start, end, name or "<unnamed range>")))
    index = RangeIndex(ranges, pick=pick, name_filter=name_filter)
    if not len(index):
        notes.append("no NVTX ranges" + (" match the phase filter" if name_filter else "") +
                     ": every activity is in phase '(none)'")
        return False
    launch: dict[tuple, tuple[int, int]] = {}
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
        for tid, corr, start in db.execute("SELECT globalTid, correlationId, start FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
            launch[(tid & _PID_MASK, corr)] = (tid, start)
            launch.setdefault((None, corr), (tid, start))
    queries = []
    unlaunched = 0
    for key in keys:
        q = launch.get(key) if key[0] is not None else launch.get((None, key[1]))
        unlaunched += q is None
        queries.append(q if q is not None else (None, 0))
    if unlaunched:
        notes.append(f"{unlaunched} of {len(keys)} GPU ops have no launch call in CUPTI_ACTIVITY_KIND_RUNTIME "
                     "(a trimmed export?), so no range can claim them: they are in phase '(none)'")
    for a, name in zip(acts, index.lookup(queries), strict=True):
        a.phase = name
    return True
