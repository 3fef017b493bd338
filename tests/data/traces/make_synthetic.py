"""Writes the synthetic_* fixtures next to this file: one known timeline in every format and nsys mode.

Run: .venv/bin/python tests/data/traces/make_synthetic.py   (deterministic; the outputs are committed)

The timeline (device 0, ns from the first start; tests/test_gaps.py holds the expected numbers):
  [0, 10000)        GEMM (cuBLAS)                         stream 7   launched in "draft"
  gap 500           -> RMSNorm [10500, 13000)             stream 7   "draft"
  [12000, 20000)    attention (FlashInfer decode)         stream 8   "draft"  (overlaps: no gap)
  gap 2000          -> memcpy DtoD [22000, 24000)                    "verify"
  gap 5000          -> memset [29000, 30000)                         "verify"
  [30000, 80000)    a synchronization row: NOT busy
  gap 50000         -> argmax reduce_kernel [80000, 81000)           "accept"
  gap 200000        -> residual add [281000, 282000)                 no range
Ranges: "decode_step" (outer) holds "draft", "verify", "accept"; the last kernel is outside all of them.
span 282000, busy 24500, idle 257500. Device 1 (nsys and Kineto): two NCCL kernels with a 2000 ns gap.

Files: synthetic_nsys_2022.sqlite (old schema: EXPORT_META_DATA, no greenContextId/graph columns,
NVTX text inline), synthetic_nsys_node_mode.sqlite (2024+ schema, the first three kernels replayed
from a CUDA graph recorded with --cuda-graph-trace=node), synthetic_nsys_graph_mode.sqlite (graph mode:
one GRAPH_TRACE row stands for the graph's kernels), synthetic_nsys_graph_mode_no_table.sqlite (graph
launches whose kernels are missing and no GRAPH_TRACE table: must be refused),
synthetic_cuda_gpu_trace.csv (`nsys stats --report cuda_gpu_trace --format csv` columns),
synthetic_kineto_spec.json (ns-precision Kineto with record_function ranges and a cuda_sync event).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASE = 1_000_000_000  # GPU clock origin (ns)
CPU = 999_900_000  # CPU-side times (launches, ranges) on the same clock
PID = 7 << 24
TID = PID | 42

GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
NORM = "triton_red_fused_add_rms_norm_0"
ATTN = "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 4u, 8u, 16u, 1u, 8u, flashinfer::PageStorage>(...)"
ARGMAX = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
          "long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)")
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
       "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")
NCCL = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"

# (kind, name, start, end, stream, correlation, cpu launch time, device)
TIMELINE = [
    ("kernel", GEMM, 0, 10_000, 7, 101, 2_000, 0),
    ("kernel", NORM, 10_500, 13_000, 7, 102, 3_000, 0),
    ("kernel", ATTN, 12_000, 20_000, 8, 103, 4_000, 0),
    ("memcpy", "DtoD", 22_000, 24_000, 7, 104, 12_000, 0),
    ("memset", "", 29_000, 30_000, 7, 105, 13_000, 0),
    ("kernel", ARGMAX, 80_000, 81_000, 7, 106, 22_000, 0),
    ("kernel", ADD, 281_000, 282_000, 7, 107, 90_000, 0),
    ("kernel", NCCL, 0, 5_000, 9, 201, 2_500, 1),
    ("kernel", NCCL, 7_000, 9_000, 9, 202, 2_600, 1),
]
SYNC = (30_000, 80_000, 7, 0)  # start, end, stream, device
RANGES = [("decode_step", 1_000, 60_000), ("draft", 1_500, 10_000), ("verify", 11_000, 20_000),
          ("accept", 21_000, 30_000)]


def _new(path: Path) -> sqlite3.Connection:
    path.unlink(missing_ok=True)
    return sqlite3.connect(path)


def _strings(db: sqlite3.Connection, names: list[str]) -> dict[str, int]:
    db.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    ids = {n: i for i, n in enumerate(dict.fromkeys(names))}
    db.executemany("INSERT INTO StringIds VALUES (?, ?)", [(i, n) for n, i in ids.items()])
    return ids


def _runtime(db: sqlite3.Connection, sid: dict[str, int], rows: list[tuple[str, int, int]]) -> None:
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER, end INTEGER, eventClass INTEGER, "
               "globalTid INTEGER, correlationId INTEGER, nameId INTEGER, returnValue INTEGER, callchainId INTEGER)")
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?, ?, 1, ?, ?, ?, 0, NULL)",
                   [(CPU + t, CPU + t + 500, TID, corr, sid[name]) for name, corr, t in rows])


def _nvtx(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, rangeId INTEGER, "
               "category INTEGER, color INTEGER, text TEXT, globalTid INTEGER, endGlobalTid INTEGER, "
               "textId INTEGER, domainId INTEGER)")
    db.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, 59, NULL, NULL, NULL, ?, ?, NULL, NULL, 0)",
                   [(CPU + s, CPU + e, name, TID) for name, s, e in RANGES])


def _sync(db: sqlite3.Connection) -> None:
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_SYNCHRONIZATION (start INTEGER, end INTEGER, deviceId INTEGER, "
               "contextId INTEGER, streamId INTEGER, correlationId INTEGER, globalPid INTEGER, syncType INTEGER, "
               "eventId INTEGER)")
    s, e, stream, dev = SYNC
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_SYNCHRONIZATION VALUES (?, ?, ?, 1, ?, 999, ?, 3, 0)",
               (BASE + s, BASE + e, dev, stream, PID))


def _meta_new(db: sqlite3.Connection, mode: str) -> None:
    db.execute("CREATE TABLE META_DATA_EXPORT (name TEXT NOT NULL, value TEXT)")
    db.executemany("INSERT INTO META_DATA_EXPORT VALUES (?, ?)",
                   [("EXPORT_PRODUCT_VERSION", "2024.5.1.113"), ("EXPORT_SCHEMA_VERSION", "3.13.2")])
    db.execute("CREATE TABLE META_DATA_CAPTURE (name TEXT NOT NULL, value TEXT)")
    db.execute("INSERT INTO META_DATA_CAPTURE VALUES ('CUDA_GRAPH_TRACE_OPTIONS:MODE', ?)", (mode,))


def _kernel_table(db: sqlite3.Connection, new: bool) -> None:
    extra = ", greenContextId INTEGER, graphNodeId INTEGER, graphId INTEGER" if new else ""
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, deviceId INTEGER, "
               "contextId INTEGER, streamId INTEGER, correlationId INTEGER, globalPid INTEGER, demangledName INTEGER, "
               f"shortName INTEGER{extra})")


def _copies(db: sqlite3.Connection, rows: list[tuple]) -> None:
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER, end INTEGER, deviceId INTEGER, "
               "contextId INTEGER, streamId INTEGER, correlationId INTEGER, globalPid INTEGER, bytes INTEGER, "
               "copyKind INTEGER)")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_MEMSET (start INTEGER, end INTEGER, deviceId INTEGER, "
               "contextId INTEGER, streamId INTEGER, correlationId INTEGER, globalPid INTEGER, value INTEGER, "
               "bytes INTEGER)")
    for kind, _, s, e, stream, corr, _, dev in rows:
        if kind == "memcpy":
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?, ?, ?, 1, ?, ?, ?, 4096, 8)",
                       (BASE + s, BASE + e, dev, stream, corr, PID))
        elif kind == "memset":
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMSET VALUES (?, ?, ?, 1, ?, ?, ?, 0, 4096)",
                       (BASE + s, BASE + e, dev, stream, corr, PID))


def nsys_2022(path: Path) -> None:
    db = _new(path)
    names = [r[1] for r in TIMELINE] + ["cudaLaunchKernel_v7000", "cudaMemcpyAsync_v3020", "cudaMemsetAsync_v3020"]
    sid = _strings(db, names)
    db.execute("CREATE TABLE EXPORT_META_DATA (name TEXT NOT NULL, value TEXT)")
    db.executemany("INSERT INTO EXPORT_META_DATA VALUES (?, ?)",
                   [("EXPORT_PRODUCT_VERSION", "2022.1.1.61"), ("EXPORT_SCHEMA_VERSION", "2.7.1")])
    _kernel_table(db, new=False)
    for kind, name, s, e, stream, corr, _, dev in TIMELINE:
        if kind == "kernel":
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?)",
                       (BASE + s, BASE + e, dev, stream, corr, PID, sid[name], sid[name]))
    _copies(db, TIMELINE)
    _sync(db)
    launch = {"kernel": "cudaLaunchKernel_v7000", "memcpy": "cudaMemcpyAsync_v3020", "memset": "cudaMemsetAsync_v3020"}
    _runtime(db, sid, [(launch[k], corr, t) for k, _, _, _, _, corr, t, _ in TIMELINE])
    _nvtx(db)
    db.commit()
    db.close()


def nsys_node_mode(path: Path) -> None:
    """The first three kernels come from one graph replay (one cudaGraphLaunch, shared correlationId)."""
    db = _new(path)
    names = [r[1] for r in TIMELINE] + ["cudaLaunchKernel_v7000", "cudaMemcpyAsync_v3020", "cudaMemsetAsync_v3020",
                                        "cudaGraphLaunch_v10000"]
    sid = _strings(db, names)
    _meta_new(db, "Node")
    _kernel_table(db, new=True)
    for kind, name, s, e, stream, corr, _, dev in TIMELINE:
        if kind == "kernel":
            graph = corr <= 103
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?, 1, ?, ?, ?, ?, ?, 0, ?, ?)",
                       (BASE + s, BASE + e, dev, stream, 100 if graph else corr, PID, sid[name], sid[name],
                        corr if graph else None, 5 if graph else None))
    _copies(db, TIMELINE)
    _sync(db)
    launch = {"kernel": "cudaLaunchKernel_v7000", "memcpy": "cudaMemcpyAsync_v3020", "memset": "cudaMemsetAsync_v3020"}
    rows = [("cudaGraphLaunch_v10000", 100, 2_000)]
    rows += [(launch[k], corr, t) for k, _, _, _, _, corr, t, _ in TIMELINE if corr > 103]
    _runtime(db, sid, rows)
    _nvtx(db)
    db.commit()
    db.close()


def nsys_graph_mode(path: Path, with_graph_table: bool) -> None:
    """Eager add [0, 1000), graph replay [3000, 50000) (kernels absent), eager argmax [51000, 52000)."""
    db = _new(path)
    sid = _strings(db, [ADD, ARGMAX, "cudaLaunchKernel_v7000", "cudaGraphLaunch_v10000"])
    _meta_new(db, "Graph")
    _kernel_table(db, new=True)
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, 1, ?, ?, ?, 0, NULL, NULL)",
               (BASE, BASE + 1_000, PID, sid[ADD], sid[ADD]))
    db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, 0, 1, 7, 3, ?, ?, ?, 0, NULL, NULL)",
               (BASE + 51_000, BASE + 52_000, PID, sid[ARGMAX], sid[ARGMAX]))
    if with_graph_table:
        db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_GRAPH_TRACE (start INTEGER, end INTEGER, deviceId INTEGER, "
                   "contextId INTEGER, greenContextId INTEGER, streamId INTEGER, correlationId INTEGER, "
                   "globalPid INTEGER, graphId INTEGER, graphExecId INTEGER)")
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_GRAPH_TRACE VALUES (?, ?, 0, 1, 0, 7, 2, ?, 1, 1)",
                   (BASE + 3_000, BASE + 50_000, PID))
    _runtime(db, sid, [("cudaLaunchKernel_v7000", 1, 100), ("cudaGraphLaunch_v10000", 2, 200),
                       ("cudaLaunchKernel_v7000", 3, 300)])
    db.commit()
    db.close()


def cuda_gpu_trace_csv(path: Path) -> None:
    cols = ["Start (ns)", "Duration (ns)", "CorrId", "GrdX", "GrdY", "GrdZ", "BlkX", "BlkY", "BlkZ", "Reg/Trd",
            "StcSMem (MB)", "DymSMem (MB)", "Bytes (MB)", "Throughput (MB/s)", "SrcMemKd", "DstMemKd", "Device", "Ctx",
            "GreenCtx", "Strm", "Name"]
    lines = ["", "Processing [report1.sqlite] with [/opt/nvidia/nsight-systems/reports/cuda_gpu_trace.py]... ", "",
             ",".join(f'"{c}"' for c in cols)]
    for kind, name, s, e, stream, corr, _, dev in TIMELINE:
        label = {"memcpy": "[CUDA memcpy Device-to-Device]", "memset": "[CUDA memset]"}.get(kind, name)
        grid = ["", "", "", "", "", "", "", ""] if kind != "kernel" else ["132", "1", "1", "128", "1", "1", "40", "0.000"]
        mem = ["0.004", "2048.000", "Device", "Device"] if kind != "kernel" else ["", "", "", ""]
        row = [str(BASE + s), str(e - s), str(corr), *grid, "0.000" if kind == "kernel" else "", *mem,
               f"NVIDIA H200 ({dev})", "1", "", str(stream), label]
        lines.append(",".join(f'"{v}"' for v in row))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _us(ns: int) -> str:
    """A 16-digit microsecond stamp with ns decimals, as newer Kineto writes it."""
    return f"{ns // 1000}.{ns % 1000:03d}"


def kineto_spec(path: Path) -> None:
    base_us = 1_712_195_495_500_000_000  # ns; 16 integer digits in us
    ev: list[str] = []
    for kind, name, s, e, stream, corr, t, dev in TIMELINE:
        cat = {"kernel": "kernel", "memcpy": "gpu_memcpy", "memset": "gpu_memset"}[kind]
        label = {"memcpy": "Memcpy DtoD (Device -> Device)", "memset": "Memset (Device)"}.get(kind, name)
        args = {"device": dev, "stream": stream, "correlation": corr, "External id": corr}
        ev.append(f'{{"ph": "X", "cat": "{cat}", "name": {json.dumps(label)}, "pid": {dev}, "tid": {stream}, '
                  f'"ts": {_us(base_us + s)}, "dur": {_us(e - s)}, "args": {json.dumps(args)}}}')
        ev.append(f'{{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 100, "tid": 100, '
                  f'"ts": {_us(base_us - 100_000 + t)}, "dur": 0.500, "args": {{"correlation": {corr}}}}}')
    s, e, stream, dev = SYNC
    ev.append(f'{{"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": {dev}, "tid": {stream}, '
              f'"ts": {_us(base_us + s)}, "dur": {_us(e - s)}, "args": {{"device": {dev}, "stream": {stream}}}}}')
    for i, (name, rs, re_) in enumerate(RANGES):
        label = f"{name}#{i + 1}" if name == "decode_step" else name
        ev.append(f'{{"ph": "X", "cat": "user_annotation", "name": "{label}", "pid": 100, "tid": 100, '
                  f'"ts": {_us(base_us - 100_000 + rs)}, "dur": {_us(re_ - rs)}, "args": {{}}}}')
    text = '{"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": [\n  ' + ",\n  ".join(ev) + "\n]}\n"
    path.write_text(text, encoding="utf-8")


def main() -> None:
    nsys_2022(HERE / "synthetic_nsys_2022.sqlite")
    nsys_node_mode(HERE / "synthetic_nsys_node_mode.sqlite")
    nsys_graph_mode(HERE / "synthetic_nsys_graph_mode.sqlite", with_graph_table=True)
    nsys_graph_mode(HERE / "synthetic_nsys_graph_mode_no_table.sqlite", with_graph_table=False)
    cuda_gpu_trace_csv(HERE / "synthetic_cuda_gpu_trace.csv")
    kineto_spec(HERE / "synthetic_kineto_spec.json")


if __name__ == "__main__":
    main()
