"""The one table of `SPECBENCH_*` environment variables, and the only code that reads them.

Contract:
- `VARS` holds every `SPECBENCH_*` variable the code, the scripts and the tests read: its name, kind (flag, int,
  float, str, path, choice, list), default and what it sets (`field`: the EngineConfig / SpecConfig field whose
  default it is, for those that are one). docs/env.md holds the table as `markdown()` renders it
  (tests/test_env_table.py checks that, and that nothing outside this module reads a `SPECBENCH_` variable).
- `get(name)` reads a variable through its row: unset or empty (for every kind but str and path, blank too) gives
  the default. A name that is not in the table is a KeyError, so a typo cannot silently read nothing. A value the
  row does not accept is an `EnvError` (a ValueError) in one line, `NAME='value' is invalid: expected ...`.
  `flag(name)` is `get` for an on/off switch, typed; `default(name)` is the row's default.
- One set of words for every on/off switch, any case: `TRUE_WORDS` (1, true, yes, on) and `OFF_WORDS` (0, false,
  off, no), the words engine strings take for their 0/1 options too (harness/engines.py).
- Values are read when asked for (a config built, a server started), never cached here. Writing a variable (a
  benchmark switching one, a script exporting one) is not reading it, and happens where it is needed.
Anything may import this module: it imports nothing of ours and no third-party package (the kernels and
engine/config.py read their switches through it without torch). `python -m specbench.env` prints the table.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TRUE_WORDS = ("1", "true", "yes", "on")
OFF_WORDS = ("0", "false", "off", "no")
FLAG_WORDS: Mapping[str, bool] = {**{w: True for w in TRUE_WORDS}, **{w: False for w in OFF_WORDS}}
KINDS = ("flag", "int", "float", "str", "path", "choice", "list")
_INT = re.compile(r"[+-]?\d+", re.ASCII)


class EnvError(ValueError):
    """A `SPECBENCH_*` variable holds a value its row does not accept; the message names it and what is."""


@dataclass(frozen=True)
class Var:
    """One row of the table. `words` (flag, choice): the accepted words, any case, and the value each means;
    `lo` / `hi` (int, float): bounds; `accepted`: the "expected ..." text of a refusal where the kind's own
    would say less; `shown`: the default as the docs show it, where the value is None (unset) or a default the
    reader computes."""

    name: str
    kind: str
    default: Any
    sets: str
    field: str | None = None
    words: Mapping[str, Any] | None = None
    lo: float | None = None
    hi: float | None = None
    accepted: str | None = None
    shown: str | None = None

    def __post_init__(self) -> None:
        if not self.name.startswith("SPECBENCH_") or self.kind not in KINDS:
            raise ValueError(f"env row {self.name!r}: a SPECBENCH_ name and a kind of {', '.join(KINDS)}")
        if self.kind == "flag" and self.words is None:
            object.__setattr__(self, "words", FLAG_WORDS)
        if self.kind in ("flag", "choice") and not self.words:
            raise ValueError(f"env row {self.name}: a {self.kind} needs its words")

    @property
    def choices(self) -> tuple[Any, ...]:
        """A choice's values, each once, in the order of its words (aliases map onto them)."""
        return tuple(dict.fromkeys((self.words or {}).values()))

    def expected(self) -> str:
        if self.accepted:
            return self.accepted
        if self.kind == "flag":
            return "0 or 1 (unset: the default)"
        if self.kind == "choice":
            return _either([str(c) for c in self.choices])
        return ("an integer" if self.kind == "int" else "a number") + self._range()

    def _range(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f" in [{_num(self.lo)}, {_num(self.hi)}]"
        if self.lo is not None:
            return f" >= {_num(self.lo)}"
        return f" <= {_num(self.hi)}" if self.hi is not None else ""

    def parse(self, raw: str | None) -> Any:
        """The value `raw` (the variable's text, None when unset) means under this row."""
        if self.kind in ("str", "path"):  # taken as written: a key of spaces is a key, not an unset variable
            return self.default if not raw else raw
        text = (raw or "").strip()
        if not text:
            return self.default
        if self.kind == "list":
            return tuple(x.strip() for x in text.split(",") if x.strip())
        if self.kind in ("flag", "choice"):
            words = self.words or {}
            if text.lower() not in words:
                raise self._bad(text)
            return words[text.lower()]
        try:
            v: float = int(text) if self.kind == "int" and _INT.fullmatch(text) else float(text)
        except ValueError:
            raise self._bad(text) from None
        if self.kind == "int" and not isinstance(v, int) or not math.isfinite(v):
            raise self._bad(text)
        if (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            raise self._bad(text)
        return v

    def _bad(self, text: str) -> EnvError:
        return EnvError(f"{self.name}={text!r} is invalid: expected {self.expected()}")

    def kind_text(self) -> str:
        """The kind as the docs' table shows it."""
        if self.kind == "choice":
            words = self.words or {}
            aliases = ["/".join(w for w, to in words.items() if to == c and w != c) + f" = {c}" for c in self.choices
                       if any(to == c and w != c for w, to in words.items())]
            return "choice: " + ", ".join(str(c) for c in self.choices) + (f" ({'; '.join(aliases)})" if aliases
                                                                             else "")
        if self.kind == "flag" and self.words is not FLAG_WORDS:
            return "flag: " + " or ".join(self.words or {})
        if self.kind in ("int", "float"):
            return self.kind + self._range()
        return {"list": "comma list"}.get(self.kind, self.kind)

    def default_text(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return _num(self.default) if isinstance(self.default, int | float) else str(self.default)


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def _either(names: list[str]) -> str:
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


_ROWS = (
    # The engine's configuration (engine/config.py): each is the default of the field it names.
    Var("SPECBENCH_SPEC_LOGPROBS", "flag", True, "requests that ask for logprobs speculate (0: they run span-1)",
        field="SpecConfig.logprobs"),
    Var("SPECBENCH_SPEC_GATE", "int", 0, "the max-batch gate: a step with more running requests is a one-token round",
        field="SpecConfig.gate", lo=0, accepted="an integer >= 0 (0 = off)"),
    Var("SPECBENCH_SPEC_TRIM", "int", 0, "the draft trim: only the first k drafts enter the verify span",
        field="SpecConfig.trim", lo=0, accepted="an integer >= 0 (0 = off)"),
    Var("SPECBENCH_SPEC_POLICY", "choice", "off", "the span policy: fixed spans, or each step's span from the "
        "cost model and the running acceptance", field="SpecConfig.policy",
        words={"off": "off", "auto": "auto", "0": "off", "1": "auto"}, accepted="off, auto, 0 or 1"),
    Var("SPECBENCH_GRAPH_RUNNER", "flag", None, "the graph runners: unset on CUDA only, 1 on CPU too (bodies run "
        "eagerly), 0 nowhere", field="EngineConfig.graph_runner", shown="unset (CUDA only)"),
    Var("SPECBENCH_WHOLE_GRAPHS", "flag", True, "padded steps with no prefill chunk as one CUDA graph each",
        field="EngineConfig.whole_graphs"),
    Var("SPECBENCH_WHOLE_PREFILL", "int", 0, "prefill-mixed steps whole too, for chunks of at most this many tokens",
        field="EngineConfig.whole_prefill", lo=0, accepted="an integer >= 0 (0 = off)"),
    Var("SPECBENCH_DEFER_DRAFTS", "flag", True, "greedy DFlash drafts stay on the device until the accept",
        field="EngineConfig.defer_drafts"),
    Var("SPECBENCH_PADDED_ROWS", "choice", "ladder", "the rows a prefill-mixed step of the padded runner is padded "
        "to", field="EngineConfig.padded_rows", words={"ladder": "ladder", "bucket": "bucket"}),
    Var("SPECBENCH_GRAPH_LOGITS", "flag", False, "the logits of every padded row inside the captured tail",
        field="EngineConfig.graph_logits"),
    Var("SPECBENCH_GRAPH_CONTEXT", "flag", True, "the drafter's context rows written inside the target's captured "
        "step", field="EngineConfig.graph_context"),
    Var("SPECBENCH_GEMV", "flag", True, "Triton GEMVs (add + RMSNorm fused) for decode-sized steps",
        field="EngineConfig.gemv"),
    Var("SPECBENCH_SKINNY", "flag", False, "tensor-core skinny GEMMs for steps of 2..64 rows (needs gemv)",
        field="EngineConfig.skinny"),
    Var("SPECBENCH_SELECTOR_KERNEL", "flag", True, "DFlash2's candidate-selector walk as one Triton launch",
        field="EngineConfig.selector_kernel"),
    Var("SPECBENCH_DECODE_ATTENTION", "choice", "triton", "the attention of decode-only steps on the FlashInfer "
        "backend", field="EngineConfig.decode_attention", words={"flashinfer": "flashinfer", "triton": "triton"}),
    Var("SPECBENCH_INCREMENTAL_DETOK", "flag", True, "streamed text in O(new tokens) per step",
        field="EngineConfig.incremental_detok"),
    Var("SPECBENCH_ADMIT_INBOX", "flag", True, "add_request leaves a request in an inbox instead of waiting for the "
        "step in flight", field="EngineConfig.admit_inbox"),
    Var("SPECBENCH_DECODE_AHEAD", "flag", True, "plain decode one step ahead", field="EngineConfig.decode_ahead"),
    Var("SPECBENCH_GATED_AHEAD", "flag", True, "gated (one-token) rounds one step ahead too",
        field="EngineConfig.gated_ahead"),
    Var("SPECBENCH_INVARIANTS", "flag", False, "the run-time invariants after every step (tests/conftest.py sets "
        "it)", field="EngineConfig.check_invariants"),
    Var("SPECBENCH_PREFIX_CACHE", "flag", True, "the prefix cache", field="EngineConfig.prefix_cache"),
    # The engine and the kernels, outside the configuration.
    Var("SPECBENCH_TRITON", "flag", True, "the Triton kernels on CUDA (kernels/__init__.py; EngineConfig.triton is "
        "the engine's own switch)"),
    Var("SPECBENCH_DECODE_SPLITS", "int", None, "the split-K decode attention's splits per request, forced "
        "(kernels/decode_attention.py; at least 1)", shown="unset (from the SM count)"),
    Var("SPECBENCH_DECODE_MERGE", "choice", "separate", "the split-K decode attention's merge: its own launch, or "
        "inside the split kernel", words={"separate": "separate", "fused": "fused", "0": "separate",
                                          "off": "separate", "false": "separate", "1": "fused", "on": "fused",
                                          "true": "fused"}),
    Var("SPECBENCH_GEMV_KINDS", "list", None, "the Triton GEMV kinds allowed, of plain, norm, swiglu (kernels/gemv.py;"
        " other entries ignored)", shown="all"),
    Var("SPECBENCH_FLASHINFER_TOPK", "flag", False, "DFlash2's top-k through FlashInfer's radix kernel on CUDA, "
        "where it exists (engine/spec/selector.py)"),
    Var("SPECBENCH_SPEC_ONLINE", "flag", True, "measured step times correct the span policy's cost model (0: the "
        "model alone)"),
    Var("SPECBENCH_SPEC_COSTS", "path", None, "a saved CostModel.describe() JSON, used instead of measuring at "
        "start-up"),
    Var("SPECBENCH_STEP_TRACE", "int", 4096, "the span policy's trace entries kept (0 = off)", lo=0),
    # The harness and the server.
    Var("SPECBENCH_RESULTS", "path", None, "the results store (a command's --results-dir / --out wins)",
        shown="./results"),
    Var("SPECBENCH_ENGINE_PROCESS", "flag", True, "specbench serve: the engine in a process of its own "
        "(--engine-process / --no-engine-process win)", words={"0": False, "1": True},
        accepted="0 (the engine in the server's process) or 1 (in a process of its own)"),
    Var("SPECBENCH_GIL_SWITCH_MS", "float", 5.0, "specbench serve: Python's thread switch interval, in ms "
        "(--gil-switch-ms wins)", lo=0.01, hi=100.0, accepted="a number of ms in [0.01, 100]"),
    Var("SPECBENCH_API_KEY", "str", None, "specbench serve: the key every route but /health needs (--api-key wins)",
        shown="unset (open)"),
    Var("SPECBENCH_COALESCE", "flag", False, "the server merges a slow stream's queued outputs into one event"),
    Var("SPECBENCH_CHILD_SENDER", "flag", True, "the engine process sends each step's message from a sender thread"),
    Var("SPECBENCH_MAX_JSON_VALUES", "int", 262_144, "the server refuses a body with more ',' and ':' separators "
        "(413)", lo=0, accepted="an integer >= 0 (0 = no bound)"),
    Var("SPECBENCH_BATCH_DELIVERY", "flag", True, "the engine loop hands each event loop one batch per step (0: one "
        "call per delta)"),
    Var("SPECBENCH_RAW_HTTP", "flag", True, "the openai adapter's raw HTTP/1.1 client on plain http:// (0: always "
        "httpx)"),
    # llama.cpp, the foreign engine (harness/foreign/, tests/foreign/).
    Var("SPECBENCH_LLAMACPP", "choice", "1", "the llama.cpp tests: run (building once), skip, or run only when "
        "already built", words={"1": "1", "0": "0", "cached": "cached", "on": "1", "true": "1", "yes": "1",
                                "off": "0", "false": "0", "no": "0"}),
    Var("SPECBENCH_LLAMACPP_CACHE", "path", "~/.cache/specbench/llamacpp", "the llama.cpp build cache's root"),
    Var("SPECBENCH_LLAMACPP_SDIST", "path", None, "a local copy of the pinned llama.cpp sdist, used instead of "
        "downloading it"),
    Var("SPECBENCH_LLAMACPP_JOBS", "int", 0, "make -j of the llama.cpp build", lo=0, shown="0 (min(2, CPUs))"),
    Var("SPECBENCH_LLAMACPP_RESULTS", "path", None, "where the llama.cpp tests write their records "
        "(scripts/foreign-report.sh sets it)", shown="unset (a temp directory)"),
    Var("SPECBENCH_LLAMACPP_TEST_TIMEOUT", "int", 1800, "seconds each tests/foreign test may take (the first pays "
        "for a cold build)", lo=1),
    Var("SPECBENCH_LLAMACPP_LIFETIME", "float", 3600.0, "seconds a test llama-server may live", lo=1),
    # Scripts and tests.
    Var("SPECBENCH_MODELS", "path", "~/.cache/specbench/qwen3-4b-shape", "scripts/nightly.sh: the Qwen3-4B-shaped "
        "pair's folder (built there when absent)"),
    Var("SPECBENCH_TEST_PAIR", "str", None, "tests: target_dir,draft_dir used instead of the bundled tiny pair",
        shown="unset (the bundled pair)"),
    Var("SPECBENCH_FUZZ_EXAMPLES", "int", 1000, "tests/test_server_fuzz.py: the fuzz's examples", lo=1),
    Var("SPECBENCH_SOAK_STREAMS", "int", 256, "tests/test_server_fuzz.py: the soak's concurrent streams", lo=1),
    Var("SPECBENCH_TEST_RSS", "path", None, "tests: append each test's resident memory after it and its growth "
        "(MiB, tab-separated, with the test id) to this file", shown="unset (not recorded)"),
    Var("SPECBENCH_TEST_EVAL_SHOTS", "int", 5, "tests/test_evalparity.py: gsm8k's few-shot examples (0 for a "
        "512-context pair)", lo=0),
)
VARS: Mapping[str, Var] = {v.name: v for v in _ROWS}
if len(VARS) != len(_ROWS):
    raise ValueError("a variable is in specbench/env.py's table twice")


def row(name: str) -> Var:
    """The table's row for `name`; KeyError for a name that is not in it."""
    try:
        return VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not in specbench/env.py's table of SPECBENCH_* variables") from None


def get(name: str) -> Any:
    """The value of `name` now, by its row (see the module contract)."""
    var = row(name)
    return var.parse(os.environ.get(name))


def flag(name: str) -> bool:
    """An on/off switch whose default is on or off (not unset)."""
    var = row(name)
    if var.kind != "flag" or var.default is None:
        raise TypeError(f"{name} is no on/off flag with an on or off default (kind {var.kind}, default "
                        f"{var.default!r}): read it with env.get")
    return bool(var.parse(os.environ.get(name)))


def default(name: str) -> Any:
    return row(name).default


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """The table as docs/env.md holds it: one row per variable, in the table's order."""
    lines = ["| variable | type | default | sets |", "|---|---|---|---|"]
    for v in _ROWS:
        sets = v.sets + (f" (`{v.field}`)" if v.field else "")
        lines.append(f"| `{v.name}` | {_cell(v.kind_text())} | {_cell(v.default_text())} | {_cell(sets)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
