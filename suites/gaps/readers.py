"""Trace readers: `read_trace(path)` sniffs the format from the bytes and returns a `Trace`.

Accepted formats (the file's content decides, not its extension):
- nsys SQLite export (`nsys export --type sqlite report.nsys-rep`)      -> nsys_sqlite.py
- `nsys stats --report cuda_gpu_trace --format csv` output              -> read_nsys_csv below
- PyTorch profiler / Kineto chrome trace, plain or gzipped JSON         -> kineto.py
Anything else, or a file that cannot be read, raises GapsError naming the file and these formats.

The CSV reader's contract: the header row is the first line whose fields include "Start (<unit>)",
"Duration (<unit>)" and "Name" (nsys prints NOTICE/Processing lines before it); the unit (ns, us,
ms, s) is read from the header; Device "NVIDIA H100 ... (0)" becomes device "0"; rows named
"[CUDA memcpy ...]" / "[CUDA memset]" are memcpy / memset, the rest kernels. The report carries no
NVTX ranges and cannot show graph-mode replays, so phases are unavailable and graph kernels are only
present when the run was recorded with `--cuda-graph-trace=node`.
"""

from __future__ import annotations

import csv
import gzip
import io
import re
import zlib
from pathlib import Path

from .kineto import read_kineto
from .nsys_sqlite import read_nsys_sqlite
from .trace import Activity, GapsError, Trace, ns_from_decimal

FORMATS = ("nsys SQLite export (.sqlite)", "`nsys stats --report cuda_gpu_trace --format csv` output (.csv)",
           "PyTorch profiler / Kineto chrome trace (.json, .json.gz)")
_UNITS = {"ns": 1, "us": 1000, "ms": 1_000_000, "s": 1_000_000_000}
_HEADER_UNIT = re.compile(r"^(Start|Duration) \((ns|us|ms|s)\)$")
_DEVICE_ID = re.compile(r"\((\d+)\)\s*$")


def accepted() -> str:
    return "accepted formats: " + "; ".join(FORMATS)


def read_trace(path: Path, phases: bool = False, pick: str = "innermost",
               phase_filter: str | None = None) -> Trace:
    """Read any supported trace. `phases` fills Activity.phase from profiler ranges; `pick` is
    "innermost" or "outermost"; `phase_filter` is a regex a range name must contain to count."""
    path = Path(path)
    name_filter = None
    if phase_filter:
        try:
            name_filter = re.compile(phase_filter)
        except re.error as e:
            raise GapsError(f"--phase-filter {phase_filter!r}: bad regex ({e})") from e
    if path.suffix in (".nsys-rep", ".qdrep"):
        raise GapsError(f"{path}: an nsys report; export it first with `nsys export --type sqlite {path}` "
                        f"(or `nsys stats --report cuda_gpu_trace --format csv`); {accepted()}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise GapsError(f"{path}: cannot read it ({e.strerror or e}); {accepted()}") from e
    if raw.startswith(b"SQLite format 3\x00"):
        return read_nsys_sqlite(path, phases=phases, pick=pick, name_filter=name_filter)
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise GapsError(f"{path}: a gzip file that does not decompress ({e}); {accepted()}") from e
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
        raw = raw[3:]
    head = raw[:4096].lstrip()
    if head[:1] in (b"{", b"["):
        return read_kineto(path, raw, phases=phases, pick=pick, name_filter=name_filter)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise GapsError(f"{path}: unknown trace format (binary, not SQLite or gzip); {accepted()}") from None
    trace = read_nsys_csv(path, text)
    if phases:
        trace.notes.append("nsys stats CSV carries no NVTX ranges: every activity is in phase '(none)'")
    return trace


def _find_header(lines: list[str]) -> int | None:
    for i, line in enumerate(lines[:200]):
        if "Start (" in line and "Duration (" in line:
            fields = next(csv.reader([line]), [])
            if "Name" in fields and any(_HEADER_UNIT.match(f) for f in fields):
                return i
    return None


def read_nsys_csv(path: Path, text: str) -> Trace:
    lines = text.splitlines()
    at = _find_header(lines)
    if at is None:
        raise GapsError(f"{path}: unknown trace format (no 'Start (ns)','Duration (ns)',...,'Name' CSV header); "
                        f"{accepted()}")
    reader = csv.DictReader(io.StringIO("\n".join(lines[at:])))
    fields = reader.fieldnames or []
    start_col = next(f for f in fields if f.startswith("Start ("))
    dur_col = next((f for f in fields if f.startswith("Duration (")), None)
    start_unit = _HEADER_UNIT.match(start_col)
    dur_unit = _HEADER_UNIT.match(dur_col) if dur_col is not None else None
    if dur_col is None or start_unit is None or dur_unit is None:
        raise GapsError(f"{path}: CSV header needs 'Start (<unit>)' and 'Duration (<unit>)' with unit ns/us/ms/s")
    s_scale = _UNITS[start_unit.group(2)]
    d_scale = _UNITS[dur_unit.group(2)]
    strm_col = next((c for c in ("Strm", "Stream") if c in fields), None)
    acts: list[Activity] = []
    frac_digits = 0
    for lineno, row in enumerate(reader, at + 2):
        if not any((v or "").strip() for v in row.values() if isinstance(v, str)):
            if acts:
                break  # nsys separates reports with a blank line
            continue
        try:
            s_txt, d_txt = row[start_col].replace(",", ""), row[dur_col].replace(",", "")
            start = ns_from_decimal(s_txt, s_scale)
            end = start + max(0, ns_from_decimal(d_txt, d_scale))
        except (ValueError, AttributeError, TypeError) as e:
            raise GapsError(f"{path}:{lineno}: bad {start_col}/{dur_col} value ({e})") from e
        for txt in (s_txt, d_txt):
            frac_digits = max(frac_digits, len(txt.partition(".")[2]))
        name = (row.get("Name") or "").strip() or "<unnamed>"
        low = name.lower()
        kind = "memcpy" if low.startswith("[cuda memcpy") else "memset" if low.startswith("[cuda memset") else "kernel"
        dev_txt = (row.get("Device") or "").strip()
        m = _DEVICE_ID.search(dev_txt)
        device = m.group(1) if m else (dev_txt or "0")
        stream = (row.get(strm_col) or "").strip() if strm_col else ""
        acts.append(Activity(start, end, device, stream or "?", kind, name))
    if not acts:
        raise GapsError(f"{path}: the cuda_gpu_trace CSV has a header but no rows")
    scale = min(s_scale, d_scale)
    resolution = max(1, scale // 10 ** min(frac_digits, len(str(scale)) - 1))
    notes = []
    if resolution >= 1000:
        notes.append(f"timestamps have {resolution} ns resolution: gaps under ~3 us cannot be resolved")
    return Trace(path, "nsys-csv", acts, resolution_ns=resolution, notes=notes)
