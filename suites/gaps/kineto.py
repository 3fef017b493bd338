"""Reader for PyTorch profiler / Kineto chrome traces (`prof.export_chrome_trace`, `.json` or `.json.gz`).

Contract:
- Busy intervals are complete events (ph "X") of category kernel, gpu_memcpy, gpu_memset (older
  PyTorch: Kernel, Memcpy, Memset). cuda_sync events sit on GPU rows too but are never busy.
- Device = args.device, else the event's pid; stream = args.stream, else tid.
- ts/dur are microseconds. Newer traces carry ns precision as decimals; the literal text is converted
  to integer ns exactly (a float would lose the last digits of a 16-digit stamp). When every GPU ts
  and dur is a whole number of microseconds, the trace has integer-us resolution: `resolution_ns` is
  1000 and a note says the < 1 us and 1-3 us histogram buckets are meaningless.
- Phases (optional): record_function ranges. A GPU op belongs to the `user_annotation` range (CPU
  side) covering its launch event (cat cuda_runtime / cuda_driver with the same args.correlation) on
  the launching thread; failing that, to the `gpu_user_annotation` range covering its start on the same
  device. Innermost wins unless `pick="outermost"` (ranges.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .ranges import Range, RangeIndex
from .trace import Activity, GapsError, Trace, ns_from_decimal

_GPU_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "memcpy": "memcpy", "gpu_memset": "memset",
             "memset": "memset"}
_LAUNCH_CATS = {"cuda_runtime", "cuda_driver", "runtime"}
_RANGE_CATS = _LAUNCH_CATS | {"user_annotation", "gpu_user_annotation"}


def _is_whole_us(v: object) -> bool:
    if isinstance(v, int):
        return True
    if isinstance(v, str):
        _, _, frac = v.partition(".")
        return "e" not in v.lower() and not frac.strip("0")
    return isinstance(v, float) and v.is_integer()


def read_kineto(path: Path, raw: bytes, phases: bool = False, pick: str = "innermost",
                name_filter: re.Pattern[str] | None = None) -> Trace:
    try:
        doc = json.loads(raw, parse_float=str)
    except (ValueError, UnicodeDecodeError) as err:
        raise GapsError(f"{path}: not valid JSON ({err})") from err
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise GapsError(f"{path}: JSON without a traceEvents list; expected a PyTorch profiler / Kineto trace")
    acts: list[Activity] = []
    corrs: list[Any] = []
    whole_us = True
    cpu_ranges: list[tuple[Any, Range]] = []
    gpu_ranges: list[tuple[Any, Range]] = []
    launches: dict[Any, tuple[Any, int]] = {}
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat = str(e.get("cat", "")).lower()
        kind = _GPU_CATS.get(cat)
        if kind is None and not (phases and cat in _RANGE_CATS):
            continue
        try:
            ts, dur = e["ts"], e.get("dur", 0)
            start = ns_from_decimal(ts, 1000)
            end = start + max(0, ns_from_decimal(dur, 1000))
        except (KeyError, TypeError, ValueError) as err:
            if kind is None:
                continue
            raise GapsError(f"{path}: {cat} event {e.get('name')!r} has a bad ts/dur ({err})") from err
        raw_args = e.get("args")
        args = raw_args if isinstance(raw_args, dict) else {}
        if kind is not None:
            whole_us = whole_us and _is_whole_us(ts) and _is_whole_us(dur)
            acts.append(Activity(start, end, str(args.get("device", e.get("pid"))),
                                 str(args.get("stream", e.get("tid"))), kind, str(e.get("name", "<unnamed>"))))
            corrs.append(args.get("correlation"))
        elif cat == "user_annotation":
            cpu_ranges.append(((e.get("pid"), e.get("tid")), Range(start, end, str(e.get("name", "")))))
        elif cat == "gpu_user_annotation":
            gpu_ranges.append((str(args.get("device", e.get("pid"))), Range(start, end, str(e.get("name", "")))))
        elif cat in _LAUNCH_CATS and "correlation" in args:
            launches[args["correlation"]] = ((e.get("pid"), e.get("tid")), start)
    if not acts:
        raise GapsError(f"{path}: no kernel / gpu_memcpy / gpu_memset events; profile with "
                        "ProfilerActivity.CUDA to record the GPU timeline")
    notes: list[str] = []
    resolution = 1
    if whole_us:
        resolution = 1000
        notes.append("timestamps have integer-microsecond resolution: gaps under ~3 us cannot be resolved, so the "
                     "< 1 us and 1-3 us buckets are meaningless (record with a newer PyTorch for ns precision)")
    meta: dict[str, str] = {}
    if isinstance(doc, dict):
        for key in ("schemaVersion", "displayTimeUnit", "baseTimeNanoseconds"):
            if key in doc:
                meta[key] = str(doc[key])
    has_ranges = False
    if phases:
        has_ranges = _assign_phases(acts, corrs, cpu_ranges, gpu_ranges, launches, pick, name_filter, notes)
    return Trace(path, "kineto", acts, resolution_ns=resolution, notes=notes, meta=meta, has_ranges=has_ranges)


def _assign_phases(acts: list[Activity], corrs: list[Any], cpu_ranges: list, gpu_ranges: list,
                   launches: dict, pick: str, name_filter: re.Pattern[str] | None, notes: list[str]) -> bool:
    cpu = RangeIndex(cpu_ranges, pick=pick, name_filter=name_filter)
    gpu = RangeIndex(gpu_ranges, pick=pick, name_filter=name_filter)
    if not len(cpu) and not len(gpu):
        notes.append("no record_function ranges" + (" match the phase filter" if name_filter else "") +
                     ": every activity is in phase '(none)'")
        return False
    queries = [launches.get(c, (None, 0)) for c in corrs]
    unlaunched = sum(c not in launches for c in corrs)
    if unlaunched:
        notes.append(f"{unlaunched} of {len(corrs)} GPU ops have no cuda_runtime/cuda_driver launch event; only a "
                     "gpu_user_annotation range can claim them")
    by_launch = cpu.lookup(queries)
    by_gpu = gpu.lookup([(a.device, a.start) for a in acts])
    for a, via_cpu, via_gpu in zip(acts, by_launch, by_gpu, strict=True):
        a.phase = via_cpu if via_cpu is not None else via_gpu
    return True
