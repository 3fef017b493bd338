"""Engine strings: how every command names the engine(s) it talks to, and the adapters they build.

Forms (options are comma-separated key=value after the target):
  local[:<model_dir>][,draft=<dir>][,spec=off|dflash|ngram][,k=N][,device=cpu|cuda[:i]][,dtype=D]
        [,num_pages=N][,faults=a+b][,name=X][,tau=T][,max_num_seqs=N][,attention=auto|torch|flashinfer]
        [,eager=0|1][,graph_runner=0|1][,verify_graph=0|1][,draft_graph=0|1][,triton=0|1][,decode_tensor_cores=0|1][,gemv=0|1][,skinny=0|1][,selector_kernel=0|1]
        [,decode_ahead=0|1][,gated_ahead=0|1][,whole_graphs=0|1][,defer_drafts=0|1]
        [,decode_attention=flashinfer|triton][,padded_rows=ladder|bucket][,whole_prefill=N][,graph_logits=0|1][,graph_context=0|1][,invariants=0|1][,gate=N][,trim=K][,policy=off|auto]
        [,prefix_cache=0|1][,prefix_cache_pages=N][,capture_mb=M][,tp_emulate=N]
        (no model_dir = the bundled tiny pair; tau = synthetic acceptance length for speed curves on random
        weights, labelled, never lossless; whole_prefill=N: prefill-mixed steps whose chunks hold <= N tokens as
        one graph (EngineConfig.whole_prefill, docs/gpu.md; 0 = off); eager / verify_graph / draft_graph / triton / padded_rows /
        graph_logits / graph_context / selector_kernel / decode_ahead / gated_ahead / whole_graphs / defer_drafts: the GPU fast-path switches, docs/gpu.md, docs/dflash2.md; graph_runner=1: the graph runners on CPU too, their padded bodies run eagerly (the fast paths' host logic through any gate on CPU), graph_runner=0: the plain forward on CUDA; invariants: the engine's run-time invariants after every step,
        engine/invariants.py, on by default in gate commands: `gate_specs`; gate / trim / policy: the load-aware
        speculation levers, engine/spec/policy.py: one-token rounds above N running requests, k drafts per
        verify span, the cost-model span choice; 0 / off = off; tp_emulate=N: a TP-N engine's reduction order in
        the target's row-parallel projections, one device, EngineConfig.tp_emulate, docs/noise.md; 1 = off)
  openai:<base_url>[,model=M][,stream=0|1][,extras=0|1][,timeout=S][,retries=N][,api_key=K][,name=X]
        [,tokenizer=<dir>][,dialect=llamacpp|vllm|sglang|specbench|openai][,probe=0|1][,ready_timeout=S][,dtype=D]
        (probe: detect the endpoint's dialect and capabilities first, default on; dialect forces one;
        tokenizer: the model's own tokenizer.json for an endpoint that cannot tokenize; ready_timeout: how
        long to wait while /health answers 503, a server still warming up, default 600, 0 = never; dtype: the
        precision the server runs, as declared: float32 on both arms turns the lossless gates' strict mode on)
  hf:<model_dir>[,assistant=<dir>][,lookup=N][,device=...][,dtype=...][,name=X]
With no engine string at all, `default_engines()` gives the bundled tiny pair: the baseline with
speculation off and the candidate with speculation on (dflash; ngram while the drafter is absent).
`spec_off_twin(spec)` is the one builder of a local engine's speculation-off twin (the reference a
candidate is judged against); `baseline_and_candidate` is how every command turns its --baseline and
--candidate options into the two arms. Which method a local engine runs is `spec_method`, the one
spec-method rule (engine/config.py, re-exported here for the suites). The vocabularies an option accepts
(spec, dtype, attention, decode_attention, padded_rows, policy) are engine/config.py's, and an option that
sets an `EngineConfig` field is converted by that field's type (`ENGINE_FIELDS`, `engine_kw`).
Contract: `parse_engine` never touches the network or loads weights; it checks the form, the option
names and values, and that local directories exist, raising `EngineStringError` (a ValueError) whose
message names the bad part and lists the accepted forms. The CLI turns it into exit code 2.
"""

from __future__ import annotations

import functools
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specbench.engine.config import (
    ATTENTION_BACKENDS,
    DECODE_ATTENTION,
    DTYPES,
    PADDED_ROWS,
    SPEC_CHOICES,
    SPEC_POLICIES,
    EngineConfig,
    spec_method,
)
from specbench.env import OFF_WORDS, TRUE_WORDS

if TYPE_CHECKING:
    from .adapters.base import EngineAdapter

FORMS = (f"local[:<model_dir>][,draft=<dir>][,spec={'|'.join(SPEC_CHOICES)}][,k=N][,device=cpu|cuda][,dtype=...]",
         "openai:<base_url>[,model=M]", "hf:<model_dir>[,assistant=<dir>][,lookup=N]")
OPTIONS = {
    "local": ("draft", "spec", "k", "device", "dtype", "num_pages", "faults", "name", "max_model_len", "tau",
              "max_num_seqs", "attention", "eager", "graph_runner", "verify_graph", "draft_graph", "triton", "gemv", "skinny", "selector_kernel", "decode_ahead", "gated_ahead",
              "whole_graphs", "defer_drafts", "decode_tensor_cores", "decode_attention", "padded_rows", "graph_logits", "graph_context", "gpu_memory_utilization", "invariants", "mix",
              "gate", "trim", "policy", "prefix_cache", "prefix_cache_pages", "capture_mb", "whole_prefill",
              "spec_logprobs", "tp_emulate"),
    "openai": ("model", "stream", "extras", "timeout", "retries", "api_key", "name", "tokenizer", "dialect", "probe",
               "ready_timeout", "dtype"),
    "hf": ("assistant", "lookup", "device", "dtype", "name"),
}
BOOLS = (*TRUE_WORDS, *OFF_WORDS)  # what a 0/1 option accepts


def _truthy(v: str) -> bool:
    return v in TRUE_WORDS


# A local engine's options that are LocalAdapter.from_dirs's own arguments: the arm, its speculation and the
# SpecConfig fields (option -> (from_dirs keyword, conversion)); draft / spec / k / device / dtype / name are
# passed by name in build_adapter.
SPEC_ARGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "tau": ("synthetic_tau", float), "mix": ("ngram_mix", float), "spec_logprobs": ("spec_logprobs", _truthy),
    "gate": ("spec_gate", int), "trim": ("spec_trim", int), "policy": ("spec_policy", str)}
ARM_OPTIONS = ("draft", "spec", "k", "device", "dtype", "name", *SPEC_ARGS)
# Options named otherwise than the EngineConfig field they set; every other local option is its field's name.
RENAMED = {"attention": "attention_backend", "invariants": "check_invariants", "capture_mb": "spec_capture_cache_mb"}
ENGINE_FIELDS = {o: RENAMED.get(o, o) for o in OPTIONS["local"] if o not in ARM_OPTIONS}  # option -> field


@functools.cache
def field_type(name: str) -> Any:
    """The type an option gives EngineConfig field `name`: the field's annotation, X for X | None."""
    t = typing.get_type_hints(EngineConfig)[name]
    if isinstance(t, types.UnionType):
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def field_value(name: str, raw: str) -> Any:
    """An engine-string value as EngineConfig field `name` takes it, by the field's type: a switch (bool) from
    0/1 words, an int, a float, a `+`-separated tuple (faults), else the string."""
    t = field_type(name)
    if t is bool:
        return _truthy(raw)
    if t in (int, float):
        return t(raw)
    if typing.get_origin(t) is tuple:
        return tuple(p for p in raw.split("+") if p)
    return raw


class EngineStringError(ValueError):
    pass


@dataclass(frozen=True)
class EngineSpec:
    kind: str
    target: str
    options: dict[str, str] = field(default_factory=dict)
    raw: str = ""

    def opt_int(self, key: str) -> int | None:
        return int(self.options[key]) if key in self.options else None

    def opt_bool(self, key: str, default: bool) -> bool:
        return _truthy(self.options[key]) if key in self.options else default


def _fail(raw: str, what: str) -> EngineStringError:
    return EngineStringError(f"engine string {raw!r}: {what}. Accepted forms: " + "; ".join(FORMS))


def _check_int(raw: str, opts: dict[str, str], key: str, lo: int) -> None:
    if key in opts:
        v = opts[key]
        if not v.lstrip("-").isdigit() or int(v) < lo:
            raise _fail(raw, f"{key}={v!r} is invalid: expected an integer >= {lo}")


def _check_dir(raw: str, what: str, path: str) -> None:
    if not Path(path).is_dir():
        raise _fail(raw, f"{what} directory {path!r} does not exist")


def parse_engine(raw: str) -> EngineSpec:
    s = raw.strip()
    m = re.match(r"^([A-Za-z_]+)(:|,|$)", s)
    kind = m.group(1) if m else s.split(":")[0].split(",")[0]
    if kind not in OPTIONS or m is None:
        raise _fail(raw, f"unknown engine kind {kind!r} (expected local, openai or hf before the ':')")
    sep = m.group(2)
    rest = s[len(kind) + 1:] if sep == ":" else ("," + s[len(kind) + 1:] if sep == "," else "")
    target, *parts = rest.split(",")
    opts: dict[str, str] = {}
    for p in parts:
        key, eq, val = p.partition("=")
        if not eq or not key.strip():
            raise _fail(raw, f"option {p!r} is not key=value")
        key = key.strip()
        if key not in OPTIONS[kind]:
            raise _fail(raw, f"unknown option {key!r} for {kind} (accepted: {', '.join(OPTIONS[kind])})")
        opts[key] = val.strip()
    target = target.strip()
    if kind in ("openai", "hf") and not target:
        raise _fail(raw, f"{kind} needs a target after '{kind}:'")
    if kind == "openai" and not target.startswith(("http://", "https://")):
        raise _fail(raw, f"base_url {target!r} must start with http:// or https://")
    if kind in ("local", "hf") and target:
        _check_dir(raw, "model", target)
    for key in ("draft", "assistant", "tokenizer"):
        if key in opts:
            _check_dir(raw, key, opts[key])
    if opts.get("dialect") is not None:
        from .adapters.dialect import DIALECTS  # here, not at the top: parsing stays free of the HTTP stack

        if opts["dialect"] not in DIALECTS:
            raise _fail(raw, f"dialect={opts['dialect']!r} is invalid: expected one of {', '.join(DIALECTS)}")
    if "probe" in opts and opts["probe"] not in BOOLS:
        raise _fail(raw, f"probe={opts['probe']!r} is invalid: expected 0 or 1")
    if opts.get("spec") is not None and opts["spec"] not in SPEC_CHOICES:
        raise _fail(raw, f"spec={opts['spec']!r} is invalid: expected one of {', '.join(SPEC_CHOICES)}")
    if opts.get("dtype") is not None and opts["dtype"] not in DTYPES:
        raise _fail(raw, f"dtype={opts['dtype']!r} is invalid: expected one of {', '.join(DTYPES)}")
    dev = opts.get("device")
    if dev is not None and not (dev == "cpu" or dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
        raise _fail(raw, f"device={dev!r} is invalid: expected cpu, cuda or cuda:<index>")
    for key, lo in (("k", 1), ("lookup", 1), ("retries", 0), ("num_pages", 1), ("max_model_len", 1),
                    ("max_num_seqs", 1), ("ready_timeout", 0), ("gate", 0), ("trim", 0), ("whole_prefill", 0),
                    ("tp_emulate", 1)):
        _check_int(raw, opts, key, lo)
    if opts.get("policy") is not None and opts["policy"] not in SPEC_POLICIES:
        raise _fail(raw, f"policy={opts['policy']!r} is invalid: expected one of {', '.join(SPEC_POLICIES)}")
    if opts.get("attention") is not None and opts["attention"] not in ATTENTION_BACKENDS:
        raise _fail(raw, f"attention={opts['attention']!r} is invalid: expected one of "
                    f"{', '.join(ATTENTION_BACKENDS)}")
    if opts.get("decode_attention") is not None and opts["decode_attention"] not in DECODE_ATTENTION:
        raise _fail(raw, f"decode_attention={opts['decode_attention']!r} is invalid: expected one of "
                    f"{', '.join(DECODE_ATTENTION)}")
    if opts.get("padded_rows") is not None and opts["padded_rows"] not in PADDED_ROWS:
        raise _fail(raw, f"padded_rows={opts['padded_rows']!r} is invalid: expected one of {', '.join(PADDED_ROWS)}")
    _check_int(raw, opts, "prefix_cache_pages", 1)
    if "capture_mb" in opts:
        try:
            assert float(opts["capture_mb"]) >= 0.0
        except (ValueError, AssertionError):
            raise _fail(raw, f"capture_mb={opts['capture_mb']!r} is invalid: expected a number of MiB >= 0 "
                        "(0 = the drafter's capture cache off)") from None
    for key in (*(o for o, f in ENGINE_FIELDS.items() if field_type(f) is bool), "spec_logprobs"):
        if key in opts and opts[key] not in BOOLS:
            raise _fail(raw, f"{key}={opts[key]!r} is invalid: expected 0 or 1")
    if "gpu_memory_utilization" in opts:
        try:
            assert 0.0 < float(opts["gpu_memory_utilization"]) <= 1.0
        except (ValueError, AssertionError):
            raise _fail(raw, f"gpu_memory_utilization={opts['gpu_memory_utilization']!r} is invalid: expected a "
                        "fraction in (0, 1]") from None
    if "tau" in opts:
        try:
            assert float(opts["tau"]) >= 1.0
        except (ValueError, AssertionError):
            raise _fail(raw, f"tau={opts['tau']!r} is invalid: expected a mean acceptance length >= 1") from None
    if "mix" in opts:
        try:
            assert 0.0 <= float(opts["mix"]) < 1.0 and opts.get("spec") == "ngram"
        except (ValueError, AssertionError):
            raise _fail(raw, f"mix={opts['mix']!r} is invalid: expected a number in [0, 1) with spec=ngram "
                        "(the n-gram proposer's soft q)") from None
    if "timeout" in opts:
        try:
            assert float(opts["timeout"]) > 0
        except (ValueError, AssertionError):
            raise _fail(raw, f"timeout={opts['timeout']!r} is invalid: expected seconds > 0") from None
    if opts.get("spec") == "dflash" and "draft" not in opts and target:
        raise _fail(raw, "spec=dflash needs draft=<dir>")
    return EngineSpec(kind, target, opts, raw)


def bundled() -> tuple[str, str | None]:
    """The bundled tiny pair: (target_dir, draft_dir or None while the drafter is not built)."""
    from .fixtures import bundled_pair

    target, draft = bundled_pair()
    if not (Path(target) / "config.json").is_file():
        raise EngineStringError(f"the bundled tiny target is missing at {target}: reinstall specbench or rebuild "
                                "it with `specbench fixtures`, or name an engine (" + "; ".join(FORMS) + ")")
    return str(target), (str(draft) if draft and (Path(draft) / "config.json").is_file() else None)


# Options of a local engine that belong to its speculation or to the arm, not to the engine under it:
# the spec-off twin drops them (a twin is clean and carries its own label).
TWIN_DROPS = ("draft", "spec", "k", "tau", "faults", "name", "mix", "gate", "trim", "policy", "spec_logprobs")


def spec_off_twin(spec: EngineSpec, name: str = "baseline") -> EngineSpec:
    """The same local engine with speculation off: every engine option kept (device, dtype, pages, backends,
    switches), speculation, faults and the label dropped, spec=off, labelled `name`. The raw string is
    the engine string without the label."""
    if spec.kind != "local":
        raise EngineStringError(f"engine string {spec.raw!r} is {spec.kind}: only a local engine has a "
                                "speculation-off twin to build; name the baseline explicitly")
    opts = {k: v for k, v in spec.options.items() if k not in TWIN_DROPS}
    opts["spec"] = "off"
    head = f"local:{spec.target}" if spec.target else "local"
    raw = ",".join([head, *(f"{k}={v}" for k, v in opts.items())])
    return EngineSpec("local", spec.target, {**opts, "name": name}, raw)


def default_engines() -> tuple[EngineSpec, EngineSpec]:
    """(baseline, candidate) on the bundled pair: spec off vs spec on."""
    target, draft = bundled()
    method = spec_method("on", draft)
    opts = {"draft": draft, "spec": method} if draft else {"spec": method}
    raw = f"local:{target}" + "".join(f",{k}={v}" for k, v in opts.items())
    cand = EngineSpec("local", target, {**opts, "name": "candidate"}, raw)
    return spec_off_twin(cand), cand


def baseline_and_candidate(baseline: str | None, candidate: str | None) -> tuple[EngineSpec, EngineSpec]:
    """The two arms of a command from its --baseline / --candidate: neither = the bundled pair (spec off vs
    on); a candidate alone = that candidate and its spec-off twin (local engines only); both = as given."""
    if baseline is None and candidate is None:
        try:
            return default_engines()
        except (ImportError, FileNotFoundError) as e:
            raise EngineStringError(f"the bundled tiny pair is not available ({e}); pass --baseline and "
                                    "--candidate engine strings") from e
    if candidate is None:
        raise EngineStringError("--baseline without --candidate: give the engine under test with --candidate")
    cand = parse_engine(candidate)
    if baseline is not None:
        return parse_engine(baseline), cand
    if cand.kind != "local":
        raise EngineStringError(f"--candidate {candidate!r} is remote, so there is no speculation-off twin to "
                                "default to: give one with --baseline")
    return spec_off_twin(cand), cand


def noise_arms(noise_baseline: str | None, baseline: str | None, candidate: str | None
               ) -> tuple[EngineSpec, EngineSpec, EngineSpec]:
    """The three arms of `lossless --suite noise` (docs/noise.md): (reference, baseline, candidate). The baseline
    and candidate are `baseline_and_candidate`'s, except that with neither given the bundled candidate runs at
    emulated TP 2 (`tp_emulate=2`) when no --noise-baseline is given either. The reference is --noise-baseline
    with speculation off (a local one through `spec_off_twin`), else, for a local baseline with tp_emulate=N > 1,
    the same engine at TP 1 (tp_emulate dropped); any other baseline needs --noise-baseline."""
    if baseline is None and candidate is None and noise_baseline is None:
        _, cand = baseline_and_candidate(None, None)
        cand = EngineSpec(cand.kind, cand.target, {**cand.options, "tp_emulate": "2"}, cand.raw + ",tp_emulate=2")
        base = spec_off_twin(cand)
    else:
        base, cand = baseline_and_candidate(baseline, candidate)
    if noise_baseline is not None:
        ref = parse_engine(noise_baseline)
        ref = spec_off_twin(ref, name="reference") if ref.kind == "local" else ref
        return ref, base, cand
    if base.kind != "local" or int(base.options.get("tp_emulate", "1")) <= 1:
        raise EngineStringError("--suite noise needs --noise-baseline ENGINE: the other speculation-off configuration "
                                f"the baseline {base.raw!r} should agree with up to reduction order (TP 1 where it runs "
                                "TP 2, another batch size, another attention backend); a local baseline with "
                                "tp_emulate=N gets its TP-1 twin by default")
    ref = spec_off_twin(EngineSpec("local", base.target, {k: v for k, v in base.options.items() if k != "tp_emulate"}),
                        name="reference")
    return ref, base, cand


def gate_specs(specs: list[EngineSpec]) -> list[EngineSpec]:
    """The engines of a gate command (lossless, selftest, sampled): every local engine checks its run-time
    invariants after every step (`invariants=1`: pages per request, the pool's partition, the drafter's
    context; engine/invariants.py), so a violation fails the gate with the request, the step and the
    numbers; an engine string that says `invariants=0` (or 1) keeps its own choice. Other kinds are left
    as given (remote engines have no such switch)."""
    out = []
    for s in specs:
        if s.kind == "local" and "invariants" not in s.options:
            s = EngineSpec(s.kind, s.target, {**s.options, "invariants": "1"}, s.raw + ",invariants=1")
        out.append(s)
    return out


def fast_paths_on_cpu(spec: EngineSpec) -> EngineSpec:
    """A gate's CANDIDATE: a local engine on the CPU runs its graph runners (`graph_runner=1`: the padded bodies
    the CUDA graphs capture, run eagerly), so the gate judges the code a GPU run takes (the padded verify and
    draft runners, decode and gated rounds one step ahead, deferred drafts, the drafter's context written in
    the step), not only the plain forward; the baseline stays on the plain forward, the reference. An engine
    string that names graph_runner keeps its own choice; CUDA engines and other kinds are left as given."""
    o = spec.options
    if spec.kind != "local" or "graph_runner" in o or str(o.get("device", "cpu")).startswith("cuda"):
        return spec
    return EngineSpec(spec.kind, spec.target, {**o, "graph_runner": "1"}, spec.raw + ",graph_runner=1")


def share_gpu(specs: list[EngineSpec], utilization: float = 0.85) -> list[EngineSpec]:
    """Split one device between the local CUDA engines a command builds in one process.

    Each engine sizes its KV pool from the memory left at its start (`gpu_memory_utilization` is the share of
    the device the process may hold once it is built), so the first of two engines would take it all and the
    second would get no pool. Engines without num_pages or gpu_memory_utilization of their own get cumulative
    shares utilization * i / n (i = 1..n in build order); others are left as given."""
    def free(s: EngineSpec) -> bool:
        o = s.options
        return (s.kind == "local" and o.get("device", "cpu").startswith("cuda")
                and "num_pages" not in o and "gpu_memory_utilization" not in o)

    idx = [i for i, s in enumerate(specs) if free(s)]
    if len(idx) < 2:
        return list(specs)
    out = list(specs)
    for j, i in enumerate(idx, 1):
        s = specs[i]
        u = round(utilization * j / len(idx), 4)
        out[i] = EngineSpec(s.kind, s.target, {**s.options, "gpu_memory_utilization": str(u)},
                            s.raw + f",gpu_memory_utilization={u}")
    return out


def engine_kw(options: dict[str, str]) -> dict[str, Any]:
    """LocalAdapter.from_dirs keywords for a local engine string's options past draft / spec / k / device / dtype /
    name: each EngineConfig field an option sets (ENGINE_FIELDS), typed by the field, and the speculation
    arguments (SPEC_ARGS)."""
    kw = {f: field_value(f, options[o]) for o, f in ENGINE_FIELDS.items() if o in options}
    kw.update({arg: conv(options[o]) for o, (arg, conv) in SPEC_ARGS.items() if o in options})
    return kw


def build_adapter(spec: EngineSpec | str, name: str | None = None) -> EngineAdapter:
    """Build the adapter an engine string names (loads weights for local/hf)."""
    spec = parse_engine(spec) if isinstance(spec, str) else spec
    o = spec.options
    name = name or o.get("name")
    if spec.kind == "local":
        from .adapters.local import LocalAdapter

        target, draft = spec.target, o.get("draft")
        if not target:
            target, bdraft = bundled()
            draft = draft or bdraft
        method = spec_method(o.get("spec"), draft)
        if method == "dflash" and not draft:
            raise EngineStringError(f"engine string {spec.raw!r}: spec=dflash needs draft=<dir> "
                                    "(the bundled drafter is not built yet; use spec=ngram)")
        return LocalAdapter.from_dirs(target, draft=draft, spec=method, k=spec.opt_int("k"),
                                      device=o.get("device", "cpu"), dtype=o.get("dtype", "float32"), name=name,
                                      **engine_kw(o))
    if spec.kind == "openai":
        from .adapters.openai_api import OpenAIAdapter

        return OpenAIAdapter(spec.target, model=o.get("model"), api_key=o.get("api_key"), name=name,
                             stream=spec.opt_bool("stream", True), extras=spec.opt_bool("extras", True),
                             timeout=float(o.get("timeout", 600)), retries=int(o.get("retries", 3)),
                             probe=spec.opt_bool("probe", True), dialect=o.get("dialect"),
                             tokenizer=o.get("tokenizer"), ready_timeout=float(o.get("ready_timeout", 600)),
                             dtype=o.get("dtype"))
    from .adapters.hf import HFAdapter

    return HFAdapter(spec.target, assistant=o.get("assistant"), lookup=spec.opt_int("lookup"),
                     device=o.get("device", "cpu"), dtype=o.get("dtype", "float32"), name=name)
