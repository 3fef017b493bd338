"""specbench gaps: readers on every shipped trace, the invariants, known answers, the classifier, the CLI.

Traces live in tests/data/traces (SOURCES.md says where each came from). The synthetic_* ones encode one
known timeline (make_synthetic.py's docstring) in every format, so the expected numbers below are exact.
"""

from __future__ import annotations

import json
import sqlite3
from functools import cache
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from specbench.cli.gaps import gaps
from specbench.suites.gaps import (
    Classifier,
    GapsError,
    analyze,
    check_invariants,
    classify,
    load_rules,
    read_trace,
    render_markdown,
    render_text,
    to_json,
)
from specbench.suites.gaps.ranges import Range, RangeIndex, normalize_range_name
from specbench.suites.gaps.trace import ns_from_decimal

DATA = Path(__file__).parent / "data" / "traces"
REFUSED = {"synthetic_nsys_graph_mode_no_table.sqlite"}
TRACES = sorted(p.name for p in DATA.iterdir() if p.suffix not in (".md", ".py") and p.name not in REFUSED)
KNOWN = ["synthetic_nsys_2022.sqlite", "synthetic_nsys_node_mode.sqlite", "synthetic_cuda_gpu_trace.csv",
         "synthetic_kineto_spec.json"]
WITH_RANGES = [k for k in KNOWN if not k.endswith(".csv")]


def report(name: str, phases: bool = True, pick: str = "innermost", phase_filter: str | None = None):
    return _report(name, phases, pick, phase_filter)  # one cache key per distinct call


@cache
def _report(name: str, phases: bool, pick: str, phase_filter: str | None):
    trace = read_trace(DATA / name, phases=phases, pick=pick, phase_filter=phase_filter)
    return analyze(trace, phases=phases, phase_pick=pick, phase_filter=phase_filter)


@pytest.mark.parametrize("name", TRACES)
def test_invariants_on_every_trace(name: str) -> None:
    for pick in ("innermost", "outermost"):
        r = report(name, True, pick)
        check_invariants(r)
        assert r.devices
        for d in r.devices:
            assert d.busy_ns + d.idle_ns == pytest.approx(d.span_ns, abs=1e-6)
            assert sum(g.dur for g in d.gaps) == pytest.approx(d.idle_ns, abs=1e-6)
            assert sum(d.idle_by_class.values()) == pytest.approx(d.idle_ns, abs=1e-6)
            assert sum(p.idle_ns for p in d.phases.values()) == pytest.approx(d.idle_ns, abs=1e-6)
            doc = to_json(r)["devices"][r.devices.index(d)]
            assert sum(c["share_of_idle"] for c in doc["by_class"]) == pytest.approx(1.0 if d.idle_ns else 0.0,
                                                                                       abs=1e-4)


def _merged_busy(rows: list[tuple[int, int]]) -> int:
    """Independent union length: merge sorted intervals."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(rows):
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0)


@pytest.mark.parametrize("name", ["pipit_perlmutter-cloverleaf-cuda.sqlite", "nsysai_mfu_2gpu_before.sqlite"])
def test_busy_matches_independent_union_and_excludes_sync(name: str) -> None:
    db = sqlite3.connect(DATA / name)
    tables = {t for (t,) in db.execute("SELECT name FROM sqlite_master")}
    r = report(name)
    n_syncs = 0
    for d in r.devices:
        rows = []
        for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET"):
            if t in tables:
                rows += db.execute(f"SELECT start, end FROM {t} WHERE deviceId = ?", (int(d.device),)).fetchall()
        assert d.busy_ns == _merged_busy(rows)
        syncs = db.execute("SELECT start, end FROM CUPTI_ACTIVITY_KIND_SYNCHRONIZATION WHERE deviceId = ?",
                           (int(d.device),)).fetchall()
        if syncs:
            n_syncs += len(syncs)
            assert _merged_busy(rows + syncs) > d.busy_ns  # counting syncs would change the answer
    assert n_syncs


def test_real_trace_numbers_are_stable() -> None:
    got = {(n, d.device): (d.span_ns, d.busy_ns, len(d.gaps)) for n in TRACES if not n.startswith("synthetic")
           for d in report(n).devices}
    assert got[("nsysai_h100_2gpu_1s.sqlite", "0")] == (969_447_605, 962_890_247, 2183)
    assert got[("nsysai_mfu_2gpu_before.sqlite", "1")] == (298_661_551, 267_275_916, 2662)
    assert got[("pipit_perlmutter-cloverleaf-cuda.sqlite", "0")] == (342_407_810, 303_795_463, 1590)
    assert got[("hta_ns_resolution_rank0_v100.pt.trace.json.gz", "0")] == (480_029_179, 472_454_441, 6094)
    assert got[("hta_critical_path_alexnet_a100.json.gz", "0")] == (12_920_244_000, 66_141_000, 95)
    mfu = report("nsysai_mfu_2gpu_before.sqlite").devices[0]
    assert mfu.busy_by_class["communication"] > 0 and mfu.busy_by_class["attention"] > 0


@pytest.mark.parametrize("name", KNOWN)
def test_known_timeline_in_every_format(name: str) -> None:
    r = report(name)
    d0, d1 = r.devices
    assert (d0.device, d0.span_ns, d0.busy_ns, d0.idle_ns) == ("0", 282_000, 24_500, 257_500)  # sync row not busy
    assert [(n, ns) for _, n, ns in d0.histogram] == [(1, 500), (1, 2_000), (1, 5_000), (1, 50_000), (1, 200_000)]
    assert d0.idle_by_class == {"residual add/elementwise": 200_000, "sampling/argmax/top-k": 50_000,
                                "memcpy/memset": 7_000, "RMSNorm/LayerNorm": 500}
    assert d0.busy_by_class["GEMM"] == 10_000 and d0.busy_by_class["attention"] == 7_000
    assert (d1.idle_ns, d1.idle_by_class) == (2_000, {"communication": 2_000})
    assert r.resolution_ns == 1


@pytest.mark.parametrize("name", WITH_RANGES)
def test_phases_innermost_outermost_and_filter(name: str) -> None:
    inner = report(name, True, "innermost").devices[0].phases
    got = {k: (p.busy_ns, p.idle_ns) for k, p in inner.items()}
    assert got == {"draft": (19_500, 500), "verify": (3_000, 7_000), "accept": (1_000, 50_000),
                   "(none)": (1_000, 200_000)}
    outer = report(name, True, "outermost").devices[0].phases
    assert {k: (p.busy_ns, p.idle_ns) for k, p in outer.items()} == {"decode_step": (23_500, 57_500),
                                                                       "(none)": (1_000, 200_000)}
    only = report(name, True, "innermost", "verify").devices[0].phases
    assert {k: p.idle_ns for k, p in only.items()} == {"verify": 7_000, "(none)": 250_500}


def test_graph_mode_counts_replays_as_busy() -> None:
    r = report("synthetic_nsys_graph_mode.sqlite", False)
    (d,) = r.devices
    assert (d.span_ns, d.busy_ns, d.idle_ns) == (52_000, 49_000, 3_000)
    assert d.idle_by_class == {"CUDA graph (opaque)": 2_000, "sampling/argmax/top-k": 1_000}
    assert any("cuda-graph-trace=node" in n for n in r.notes)
    assert any("node-mode" in n for n in report("synthetic_nsys_node_mode.sqlite", False).notes)


def test_graph_mode_without_graph_table_is_refused() -> None:
    with pytest.raises(GapsError, match="graph launches have no kernels.*cuda-graph-trace=node"):
        read_trace(DATA / "synthetic_nsys_graph_mode_no_table.sqlite")


def test_kineto_resolution_detection() -> None:
    us = report("hta_critical_path_alexnet_a100.json.gz")
    assert us.resolution_ns == 1000 and any("integer-microsecond" in n for n in us.notes)
    ns = report("hta_ns_resolution_rank0_v100.pt.trace.json.gz")
    assert ns.resolution_ns == 1 and not ns.notes


def test_exact_decimal_conversion() -> None:
    assert ns_from_decimal("1712195495506161.2", 1000) == 1_712_195_495_506_161_200
    assert round(float("1712195495506161.2") * 1000) != 1_712_195_495_506_161_200  # why floats are not used
    assert ns_from_decimal("4.928", 1000) == 4928
    assert ns_from_decimal("0.0004", 1000) == 0 and ns_from_decimal("0.0005", 1000) == 1
    assert ns_from_decimal(12, 1000) == 12_000 and ns_from_decimal("1.5e3", 1000) == 1_500_000
    assert ns_from_decimal("2.5", 1_000_000) == 2_500_000 and ns_from_decimal("-3", 1) == -3


CLASSIFIED = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_kernel__5x_cublas", "GEMM"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x256x8_stage3_warpsize1x4x1_ffma_aligna4_alignc4_execute_split_k_kernel__5x_cublas", "GEMM"),
    ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_relu_bf16_32x32_128x2_tn_align8>(Params)", "GEMM"),
    ("ampere_sgemm_32x32_sliced1x4_tn", "GEMM"),
    ("volta_sgemm_64x64_nt", "GEMM"),
    ("cudnn_infer_volta_scudnn_128x64_relu_medium_nn_v1", "GEMM"),
    ("triton_tem_fused_addmm_0", "GEMM"),
    ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>(Flash_fwd_params)", "attention"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>(Params)", "attention"),
    ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<KTraits, Params>(Params)", "attention"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<(PosEncodingMode)0, 2u, 4u>(Params)", "attention"),
    ("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float>::Params)", "attention"),
    ("void <unnamed>::softmax_warp_forward<float, float, float, (int)6, (bool)0, (bool)0>(T2 *, const T1 *, int)", "attention"),
    ("triton_red_fused_add_rms_norm_0", "RMSNorm/LayerNorm"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(...)", "RMSNorm/LayerNorm"),
    ("void at::native::<unnamed>::vectorized_layer_norm_kernel<float, float, (bool)0>(int, T2, const T1 *)", "RMSNorm/LayerNorm"),
    ("void cudnn::bn_fw_tr_1C11_singleread<float, 512, true, 1, 2, 0>(cudnn::bn_fw_tr_1C11_args<float>)", "RMSNorm/LayerNorm"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)", "RoPE"),
    ("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheKernel<true, 128u>(...)", "RoPE"),
    ("triton_poi_fused_rope_1", "RoPE"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>(...)", "activation/SwiGLU"),
    ("void at::native::vectorized_elementwise_kernel<(int)8, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase &)>", "activation/SwiGLU"),
    ("triton_poi_fused_mul_silu_2", "activation/SwiGLU"),
    ("void at::native::vectorized_elementwise_kernel<(int)4, at::native::CUDAFunctor_add<float>, std::array<char *, 3>>(int, T2, T3)", "residual add/elementwise"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda>>", "residual add/elementwise"),
    ("void at::native::reduce_kernel<(int)512, (int)1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>", "residual add/elementwise"),
    ("triton_poi_fused_add_cos_sin_0", "residual add/elementwise"),
    ("void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(...)", "embedding/gather"),
    ("void at::native::vectorized_gather_kernel<(int)16, long>(char *, char *, T2 *, int, long)", "embedding/gather"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>>", "embedding/gather"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(...)", "KV copy"),
    ("void flashinfer::AppendPagedKVCacheKernel<128u, 8u, __nv_bfloat16>(...)", "KV copy"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4>>", "sampling/argmax/top-k"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(at::cuda::detail::TensorInfo<float, unsigned int>)", "sampling/argmax/top-k"),
    ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u, (cub::BlockScanAlgorithm)0>(...)", "sampling/argmax/top-k"),
    ("void cub::DeviceRadixSortOnesweepKernel<cub::DeviceRadixSortPolicy<float, long, int>::Policy900>(...)", "sampling/argmax/top-k"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<(unsigned long)4096>)", "communication"),
    ("ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclDevComm *, unsigned long, ncclWork *)", "communication"),
    ("void vllm::cross_device_reduce_1stage<__nv_bfloat16, 8>(...)", "communication"),
    ("Memcpy DtoD (Device -> Device)", "memcpy/memset"),
    ("[CUDA memcpy Host-to-Device]", "memcpy/memset"),
    ("[CUDA memset]", "memcpy/memset"),
    ("memcpy Device-to-Device", "memcpy/memset"),
    ("CUDA graph 3 replay", "CUDA graph (opaque)"),
    ("void clover::par_ranged2d_kernel<ideal_gas_kernel(int, int, int, int)>(...)", "other"),
]


@pytest.mark.parametrize(("name", "cls"), CLASSIFIED)
def test_classifier_on_real_kernel_names(name: str, cls: str) -> None:
    assert classify(name) == cls


def test_user_rules_go_first_and_accept_commas(tmp_path: Path) -> None:
    f = tmp_path / "rules.csv"
    f.write_text("# my kernels\n\nclover::par_ranged[12]d,stencil\nx{1,3}gemm,GEMM\nvectorized_elementwise,pointwise\n")
    rules = load_rules(f)
    assert rules == [("clover::par_ranged[12]d", "stencil"), ("x{1,3}gemm", "GEMM"), ("vectorized_elementwise", "pointwise")]
    c = Classifier.build(rules)
    assert c("void clover::par_ranged2d_kernel<ideal_gas_kernel>") == "stencil"
    assert c("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>") == "pointwise"
    assert c("ncclDevKernel_SendRecv") == "communication" and c.classes()[:2] == ["stencil", "pointwise"]
    r = analyze(read_trace(DATA / "pipit_perlmutter-cloverleaf-cuda.sqlite"), c)
    assert "other" not in r.devices[0].idle_by_class and r.extra_rules == rules
    check_invariants(r)


@pytest.mark.parametrize(("text", "match"), [("(unclosed,cls\n", r"rules.csv:1: bad regex"),
                                             ("no comma here\n", r"rules.csv:1: expected 'regex,class'")])
def test_bad_rules_are_refused(tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "rules.csv"
    f.write_text(text)
    with pytest.raises(GapsError, match=match):
        load_rules(f)


@pytest.mark.parametrize(("content", "suffix", "match"), [
    (b"hello, world\n1,2\n", ".csv", "unknown trace format"),
    (b"\x00\x01binary", ".bin", "unknown trace format"),
    (b'{"foo": 1}', ".json", "traceEvents"),
    (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 1, "dur": 2}]}', ".json", "no kernel"),
    (b"\x1f\x8bnot really gzip", ".json.gz", "does not decompress"),
    (b"SQLite format 3\x00" + b"\x00" * 200, ".sqlite", "not a readable SQLite"),
    (b"", ".nsys-rep", "nsys export --type sqlite"),
])
def test_bad_input_is_refused_clearly(tmp_path: Path, content: bytes, suffix: str, match: str) -> None:
    f = tmp_path / f"t{suffix}"
    f.write_bytes(content)
    with pytest.raises(GapsError, match=match) as info:
        read_trace(f)
    assert str(f) in str(info.value)
    with pytest.raises(GapsError, match="cannot read"):
        read_trace(tmp_path / "missing.json")


def test_csv_in_microseconds(tmp_path: Path) -> None:
    f = tmp_path / "us.csv"
    f.write_text('"Start (us)","Duration (us)","CorrId","Device","Strm","Name"\n'
                 '"10.000","2.500","1","GPU (0)","7","nvjet_tst_x"\n"14.000","1.000","2","GPU (0)","7","[CUDA memset]"\n')
    r = analyze(read_trace(f))
    assert (r.devices[0].span_ns, r.devices[0].idle_ns, r.resolution_ns) == (5_000, 1_500, 1)
    assert r.devices[0].idle_by_class == {"memcpy/memset": 1_500}


def test_range_index_and_names() -> None:
    assert normalize_range_name("aten::mm, seq = 3, op_id = 12, sizes = [[1, 2]]") == "aten::mm"
    assert normalize_range_name("ProfilerStep#101") == "ProfilerStep"
    assert normalize_range_name("Optimizer.step#SGD.step") == "Optimizer.step#SGD.step"
    rs = [("t", Range(0, 100, "step#1")), ("t", Range(10, 50, "draft")), ("t", Range(20, 30, "attn")),
          ("u", Range(0, 100, "other thread"))]
    inner = RangeIndex([(k, Range(r.start, r.end, r.name)) for k, r in rs])
    assert inner.lookup([("t", 25), ("t", 40), ("t", 60), ("t", 101), ("u", 5), ("v", 5)]) == \
        ["attn", "draft", "step", None, "other thread", None]
    outer = RangeIndex([(k, Range(r.start, r.end, r.name)) for k, r in rs], pick="outermost")
    assert outer.lookup([("t", 25)]) == ["step"]


def test_markdown_and_text_render() -> None:
    r = report("synthetic_nsys_2022.sqlite", True)
    md = render_markdown(r, plot="idle.png")
    assert "| gap length | gaps | idle ms | % of idle |" in md and "![GPU idle by kernel class](idle.png)" in md
    assert "| draft |" in md
    txt = render_text(r)
    assert "device 0" in txt and "busy 0.025 ms (8.7%)" in txt and "accept" in txt


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(gaps)
    return app


def test_cli_text_json_phases_and_files(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(_app(), [str(DATA / "synthetic_kineto_spec.json")])
    assert res.exit_code == 0, res.output
    assert "device 0" in res.output and "sampling/argmax/top-k" in res.output
    md, png = tmp_path / "gaps.md", tmp_path / "gaps.png"
    res = runner.invoke(_app(), [str(DATA / "synthetic_nsys_2022.sqlite"), "--json", "--phases", "--markdown",
                                 str(md), "--plot", str(png)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    dev = doc["devices"][0]
    assert (dev["span_ns"], dev["busy_ns"], dev["idle_ns"]) == (282_000, 24_500, 257_500)
    assert {p["phase"]: p["idle_ns"] for p in dev["phases"]}["accept"] == 50_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(gaps.png)" in md.read_text()
    res = runner.invoke(_app(), [str(DATA / "synthetic_nsys_2022.sqlite"), "--phases", "--outermost",
                                 "--phase-filter", "decode"])
    assert res.exit_code == 0 and "decode_step" in res.output


def test_cli_bad_input_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "notes.txt"
    bad.write_text("just some text\n")
    res = CliRunner().invoke(_app(), [str(bad)])
    assert res.exit_code == 2
    assert str(bad) in res.output and "accepted formats" in res.output and "Kineto" in res.output
    rules = tmp_path / "r.csv"
    rules.write_text("(bad,GEMM\n")
    res = CliRunner().invoke(_app(), [str(DATA / "synthetic_cuda_gpu_trace.csv"), "--rules", str(rules)])
    assert res.exit_code == 2 and "bad regex" in res.output
    res = CliRunner().invoke(_app(), [str(DATA / "synthetic_nsys_graph_mode_no_table.sqlite")])
    assert res.exit_code == 2 and "cuda-graph-trace=node" in res.output


def test_docs_show_the_rule_table_verbatim() -> None:
    from specbench.suites.gaps import RULES

    doc = (Path(__file__).parents[1] / "docs" / "gaps.md").read_text()
    for i, (pattern, cls) in enumerate(RULES, 1):
        assert f"| {i} | {cls} | `{pattern.replace('|', chr(92) + '|')}` |" in doc


def test_command_module_imports_lazily() -> None:
    import subprocess
    import sys

    code = ("import sys, specbench.cli.gaps; "
            "print(any(m.startswith(('matplotlib', 'specbench.suites')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
