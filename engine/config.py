"""Frozen configuration for the reference engine.

Contract: every dataclass here is immutable and validated on construction; a bad value raises
`ConfigError` naming the field, the value and what would be accepted. Derived values are properties.
`ModelConfig.from_dir` parses a checkpoint's config.json (fixtures and real checkpoints alike) and
`ModelConfig.from_dict` validates one already read; three other places read one for a single field or a
drafter: engine/models/dflash2.py `load_draft_config` (into `from_dict`), suites/lossless/gates/common.py
`geometry` (max_position_embeddings) and suites/lossless/checks.py `eos_ids_of` (eos_token_id). This module imports no torch and no kernel (only `require_device` imports torch, when it
is called), so the harness imports its vocabularies and the `spec_method` rule instead of copying them.

The one spec-method rule: a front door (`LLM(spec=...)`, engine strings, `serve --spec`, the adapters) names the
speculation as `spec`, resolved by `spec_method(spec, draft)`:
- None or "auto" (not said): "dflash" when a drafter is given, else "off";
- "on": "dflash" when a drafter is given, else "ngram" (the proposer that needs no drafter);
- "off", or a method of `FRONT_DOOR_METHODS`: as given;
- anything else: `ConfigError` naming `spec` and the accepted values.
`engine_method` turns the resolved name into `SpecConfig.method` (None for off). A "dflash" without a drafter is
returned as is: the engine (spec/plan.py `resolve_spec`) or the engine-string builder refuses it with the reason.

Defaults from the environment: a field that specbench/env.py's table names (its `field` column, docs/env.md) takes
its default from that `SPECBENCH_*` variable when the config is built (`_env`); a value the table refuses is a
ConfigError naming the variable.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specbench import env


class ConfigError(ValueError):
    """A configuration or request value is invalid. The message names the field."""


class DeviceUnavailable(RuntimeError):
    """The device a configuration names is not on this machine (device=cuda where torch sees no CUDA GPU): nothing
    can run or be measured here, which the CLI reports in one line as CANNOT TEST, exit 3 (harness/errors.py)."""


def require_device(device: str, who: str | None = None) -> None:
    """Raise DeviceUnavailable unless `device` (cpu, cuda, cuda:N) can be used here; `who` names what needs it
    (default: `device=...`)."""
    if not str(device).startswith("cuda"):
        return
    import torch

    who = who or f"device={device!r}"
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU answers on this machine"
        raise DeviceUnavailable(f"{who} needs a CUDA GPU, and {why}")
    idx = torch.device(device).index
    if idx is not None and idx >= torch.cuda.device_count():
        raise DeviceUnavailable(f"{who} needs CUDA GPU {idx}, and this machine has {torch.cuda.device_count()}")


def _need(cond: bool, fieldname: str, value: Any, accepted: str) -> None:
    if not cond:
        raise ConfigError(f"{fieldname}={value!r} is invalid: expected {accepted}")


def _either(names: tuple[str, ...]) -> str:
    """"a, b or c": the accepted values of a vocabulary, for a message."""
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def _env(name: str) -> Any:
    """A field's default from its `SPECBENCH_*` variable (specbench/env.py's table: unset or empty is the table's
    default); a value the table refuses is a ConfigError naming the variable and what it accepts."""
    try:
        return env.get(name)
    except env.EnvError as e:
        raise ConfigError(str(e)) from None


@dataclass(frozen=True)
class ModelConfig:
    """The subset of a HF Qwen3 (or DFlash draft) config.json the engine uses."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    architectures: tuple[str, ...] = ("Qwen3ForCausalLM",)
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: str = "float32"
    # DFlash drafter fields (None for a target).
    block_size: int | None = None
    mask_token_id: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    num_target_layers: int | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, name)
            _need(isinstance(v, int) and v > 0, f"config.{name}", v, "a positive integer")
        _need(self.num_attention_heads % self.num_key_value_heads == 0, "config.num_key_value_heads",
              self.num_key_value_heads, f"a divisor of num_attention_heads={self.num_attention_heads}")
        _need(self.head_dim % 2 == 0, "config.head_dim", self.head_dim, "an even integer (RoPE)")
        _need(self.rms_norm_eps > 0, "config.rms_norm_eps", self.rms_norm_eps, "a positive float")
        _need(self.rope_theta > 0, "config.rope_theta", self.rope_theta, "a positive float")
        if self.is_dflash:
            _need(isinstance(self.block_size, int) and self.block_size >= 2, "config.block_size",
                  self.block_size, "an integer >= 2")
            _need(isinstance(self.mask_token_id, int) and self.mask_token_id >= 0,
                  "config.dflash_config.mask_token_id", self.mask_token_id, "a token id")
            _need(bool(self.target_layer_ids), "config.dflash_config.target_layer_ids",
                  self.target_layer_ids, "a non-empty list of target decoder-layer indices")

    @property
    def is_dflash(self) -> bool:
        return any("DFlash" in a for a in self.architectures)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "max_position_embeddings")
        missing = [k for k in required if k not in raw]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim")
        if head_dim is None:
            hs = raw["hidden_size"]
            _need(isinstance(hs, int) and isinstance(heads, int) and heads > 0 and hs % heads == 0,
                  f"{source}: head_dim", None, "present, or hidden_size divisible by num_attention_heads")
            head_dim = hs // heads
        eos = raw.get("eos_token_id")
        eos_t = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        dcfg = raw.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise ConfigError(f"{source}: dflash_config must be an object, got {type(dcfg).__name__}")
        block = raw.get("block_size", dcfg.get("block_size"))
        tl = dcfg.get("target_layer_ids")
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta")
        rp = raw.get("rope_parameters")  # transformers >= 5 spelling
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rope_scaling is None and rp.get("rope_type", "default") != "default":
                rope_scaling = rp
        archs = raw.get("architectures") or ["Qwen3ForCausalLM"]
        try:
            return cls(
                vocab_size=raw["vocab_size"],
                hidden_size=raw["hidden_size"],
                intermediate_size=raw["intermediate_size"],
                num_hidden_layers=raw["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=raw.get("num_key_value_heads", heads),
                head_dim=head_dim,
                max_position_embeddings=raw["max_position_embeddings"],
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta or 10000.0),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                architectures=tuple(archs),
                eos_token_id=eos_t,
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                block_size=block,
                mask_token_id=dcfg.get("mask_token_id"),
                target_layer_ids=tuple(tl) if isinstance(tl, list) else None,
                num_target_layers=raw.get("num_target_layers"),
                raw=raw,
            )
        except TypeError as e:  # e.g. a string where a number belongs
            raise ConfigError(f"{source}: {e}") from e

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        p = Path(path)
        if not p.is_dir():
            raise ConfigError(f"model directory {str(p)!r} does not exist or is not a directory")
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ConfigError(f"{cfg}: missing; a checkpoint directory needs config.json")
        try:
            raw = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg}: malformed JSON ({e})") from e
        return cls.from_dict(raw, source=str(cfg))


GREEDY_EPS = 0.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and output options (vLLM-style names).

    temperature == 0 means greedy: an exact argmax, not a clamp. `logprobs=k` returns the top-k
    logprobs of each generated position (plus the chosen token's); `prompt_logprobs=k` (or echo) returns
    them for prompt positions.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    # vLLM's penalties: repetition (> 1 discourages every token of the prompt and the output so far: a positive
    # logit divided by it, a negative one multiplied), presence and frequency (OpenAI's: subtracted once per
    # token present in the output so far / once per occurrence). Applied to the logits before the transform,
    # greedy included; under speculation a verify row's history holds the drafts before it.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the logits before the transform, greedy
    # included (a dict is kept as sorted (id, bias) pairs: the params stay hashable)
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's min_tokens: EOS (unless ignore_eos) and stop_token_ids are masked at every position before the
    # min_tokens-th output token, and no stop (strings included) ends the request before it
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # prompt_logprobs only for prompt positions >= this (the earlier entries None, their logits never computed):
    # a scorer that wants a continuation's logprobs (the local adapter's `score`) skips the prompt's rows
    prompt_logprobs_from: int = 0
    include_stop_str_in_output: bool = False
    max_logprobs: int = 20
    # prefix-cache salt (vLLM's cache_salt): requests share cached blocks only under equal salts (None = the
    # shared cache); a fresh salt per request keeps it off every other request's blocks
    cache_salt: str | None = None
    # False: the request neither takes a prefix hit nor registers its blocks (a gate's cold request: its pages go
    # back to the free list as with the cache off, and it fills the cache with nothing no one can match)
    prompt_cache: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, list | tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        else:
            raise ConfigError(f"stop={self.stop!r} is invalid: expected a string or a list of strings")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop={list(self.stop)!r} is invalid: expected non-empty strings")
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _need(isinstance(self.stop_token_ids, tuple)
              and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", self.stop_token_ids, "a list of non-negative token ids")
        _need(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
              "max_tokens", self.max_tokens, "an integer >= 1")
        _need(isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
              and self.temperature >= 0, "temperature", self.temperature, "a finite number >= 0")
        _need(isinstance(self.top_p, int | float) and 0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")
        _need(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", self.top_k,
              "an integer >= 0 (0 or -1 = disabled)")
        _need(isinstance(self.min_p, int | float) and 0 <= self.min_p <= 1, "min_p", self.min_p, "a number in [0, 1]")
        _need(isinstance(self.repetition_penalty, int | float) and not isinstance(self.repetition_penalty, bool)
              and math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
              self.repetition_penalty, "a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _need(isinstance(v, int | float) and not isinstance(v, bool) and -2 <= v <= 2, name, v,
                  "a number in [-2, 2] (0 = off)")
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        _need(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
              and 0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
              f"an integer in [0, max_tokens={self.max_tokens}]")
        _need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
              "seed", self.seed, "an integer or null")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            _need(v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= self.max_logprobs),
                  name, v, f"null or an integer in [0, {self.max_logprobs}]")
        _need(isinstance(self.prompt_logprobs_from, int) and not isinstance(self.prompt_logprobs_from, bool)
              and self.prompt_logprobs_from >= 0, "prompt_logprobs_from", self.prompt_logprobs_from, "an integer >= 0")
        _need(self.cache_salt is None or isinstance(self.cache_salt, str), "cache_salt", self.cache_salt,
              "a string or null")
        _need(isinstance(self.prompt_cache, bool), "prompt_cache", self.prompt_cache, "true or false")

    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Any penalty on (the logits depend on the request's history, not on the position alone)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def shaped(self) -> bool:
        """The logits a token is chosen from are not the raw ones: penalties, a logit bias or min_tokens (the
        accept phase shapes the rows; decode ahead, which picks on the device from the raw rows, skips it)."""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0

    def with_(self, **kw: Any) -> SamplingParams:
        return replace(self, **kw)


LOGIT_BIAS_MAX = 100.0  # OpenAI's bound on a logit_bias value


def bias_pairs(v: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a dict (JSON's string keys allowed) or pairs; refused by
    name when an id is not a non-negative integer or a bias is not a number in [-100, 100]."""
    accepted = "a map of token id -> number in [-100, 100]"
    if v is None:
        return ()
    items = v.items() if isinstance(v, dict) else v
    _need(isinstance(items, tuple | list | type({}.items())), "logit_bias", v, accepted)
    out: dict[int, float] = {}
    for item in items:
        _need(isinstance(item, tuple | list) and len(item) == 2, "logit_bias", v, accepted)
        k, b = item
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        _need(isinstance(k, int) and not isinstance(k, bool) and k >= 0, "logit_bias", v,
              f"{accepted} (token id {k!r} is not a non-negative integer)")
        _need(isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b)
              and -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX, "logit_bias", v, f"{accepted} (token {k}: {b!r})")
        out[k] = float(b)
    return tuple(sorted(out.items()))


SPEC_METHODS = ("dflash", "ngram", "oracle")  # SpecConfig.method (None = off)
# Methods only the engine's own callers set (the oracle replays known continuations: a proposer handed to
# LLMEngine, never a name a run asks for); every other method a front door may name.
INTERNAL_SPEC_METHODS = ("oracle",)
FRONT_DOOR_METHODS = tuple(m for m in SPEC_METHODS if m not in INTERNAL_SPEC_METHODS)
SPEC_CHOICES = ("off", *FRONT_DOOR_METHODS)  # what `spec_method` resolves to; engine strings and `serve --spec`
SPEC_SWITCHES = ("auto", "on")  # besides SPEC_CHOICES and None: the choice left to the drafter's presence


def spec_method(spec: str | None, draft: str | None) -> str:
    """The speculation a front door's `spec` asks for, given a drafter directory or None: one of SPEC_CHOICES
    (the rule in the module docstring)."""
    if spec is None or spec == "auto":
        return "dflash" if draft else "off"
    if spec == "on":
        return "dflash" if draft else "ngram"
    if spec not in SPEC_CHOICES:
        raise ConfigError(f"spec={spec!r} is invalid: expected a spec method ({', '.join(SPEC_CHOICES)}), "
                          f"{' or '.join(SPEC_SWITCHES)} (a drafter's presence decides), or null (= auto)")
    return spec


def engine_method(method: str) -> str | None:
    """`SpecConfig.method` for a resolved method name: None for off."""
    return None if method == "off" else method


SPEC_POLICIES = ("off", "auto")  # SpecConfig.policy: fixed spans, or the cost-model span choice (spec/policy.py)
# The load-aware levers (issue 20) from the environment when not given: unset, "" and 0 mean off.
LEVER_ENV = {"gate": "SPECBENCH_SPEC_GATE", "trim": "SPECBENCH_SPEC_TRIM", "policy": "SPECBENCH_SPEC_POLICY"}


def lever_kw(gate: int | None = None, trim: int | None = None, policy: str | None = None) -> dict[str, Any]:
    """SpecConfig keyword arguments for the levers given (None: left to its LEVER_ENV default)."""
    return {k: v for k, v in (("gate", gate), ("trim", trim), ("policy", policy)) if v is not None}


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding switches. method=None means speculation off."""

    method: str | None = None
    num_speculative_tokens: int | None = None  # K; None = block_size - 1 for dflash, 4 for ngram
    batched_draft: bool = True
    ngram_min: int = 1
    ngram_max: int = 4
    # n-gram drafts with a soft q (0 = point masses): draft i is drawn from q_i = (1 - mix) one_hot(lookup)
    # + mix * (the context's token frequencies), so the sampled accept path sees a q that is not one-hot
    # (the sampled gate's self-test; `spec=ngram,mix=M` in engine strings)
    ngram_mix: float = 0.0
    synthetic_tau: float | None = None  # speed curves on random weights; refused by lossless suites
    sampling: bool = True  # speculative (rejection) sampling for T > 0; False = sampled requests run span-1
    # requests that ask for logprobs speculate, their logprobs read from the verify rows of the tokens they commit
    # (False, or SPECBENCH_SPEC_LOGPROBS=0: they run span-1, as before)
    logprobs: bool = field(default_factory=lambda: _env("SPECBENCH_SPEC_LOGPROBS"))
    # Load-aware levers (spec/policy.py; 0 / "off" = off; defaults from LEVER_ENV). gate=N: a step with more than N
    # running requests is a one-token verify round (no draft; the drafter's context still advances one row per
    # request, so speculation resumes without a prefill once N or fewer run); trim=k: only the first k drafts
    # enter the verify span (1 <= k <= K; the drafter still rolls its whole block); policy="auto": each step's
    # span from the start-up cost model and the running per-position acceptance.
    gate: int = field(default_factory=lambda: _env(LEVER_ENV["gate"]))
    trim: int = field(default_factory=lambda: _env(LEVER_ENV["trim"]))
    policy: str = field(default_factory=lambda: _env(LEVER_ENV["policy"]))

    def __post_init__(self) -> None:
        for name in ("gate", "trim"):
            v = getattr(self, name)
            _need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, f"spec.{name}", v,
                  "an integer >= 0 (0 = off)")
        _need(self.policy in SPEC_POLICIES, "spec.policy", self.policy, _either(SPEC_POLICIES))
        _need(self.method is None or self.method in SPEC_METHODS, "spec.method", self.method,
              f"one of {', '.join(SPEC_METHODS)} or null")
        k = self.num_speculative_tokens
        _need(k is None or (isinstance(k, int) and k >= 1), "spec.num_speculative_tokens", k, "an integer >= 1")
        _need(1 <= self.ngram_min <= self.ngram_max, "spec.ngram_min", self.ngram_min, "1 <= ngram_min <= ngram_max")
        _need(isinstance(self.ngram_mix, int | float) and 0.0 <= self.ngram_mix < 1.0, "spec.ngram_mix",
              self.ngram_mix, "a number in [0, 1)")
        _need(self.synthetic_tau is None or self.synthetic_tau >= 1.0, "spec.synthetic_tau", self.synthetic_tau,
              "null or a number >= 1.0")

    @property
    def enabled(self) -> bool:
        return self.method is not None


# The vocabularies of EngineConfig's string fields (engine strings take them from here, harness/engines.py)
DTYPES = ("float32", "bfloat16", "float16")  # EngineConfig.dtype
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")  # EngineConfig.attention_backend
DECODE_ATTENTION = ("flashinfer", "triton")  # EngineConfig.decode_attention: FlashInfer's decode steps
PADDED_ROWS = ("ladder", "bucket")  # EngineConfig.padded_rows: the padded runner's prefill-mixed row counts


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings. `num_pages=None` sizes the pool from memory (GPU) or a default (CPU)."""

    model: str
    draft: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    num_pages: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.85
    # "auto": FlashInfer on CUDA when it imports, else the torch reference (always torch on CPU).
    attention_backend: str = "auto"
    eager: bool = False  # True: no CUDA graphs (launches only; the kernels and their shapes are the same)
    # The graph runners (decode graphs, padded verify / draft runners, and what rides on them: decode ahead, gated
    # rounds ahead, deferred drafts, the drafter's context written in the step). None: on CUDA only; True: on CPU
    # too, where the bodies the graphs capture run eagerly (how CI puts the fast paths through the gates); False:
    # the plain forward everywhere. Default from SPECBENCH_GRAPH_RUNNER (0 / 1), else None.
    graph_runner: bool | None = field(default_factory=lambda: _env("SPECBENCH_GRAPH_RUNNER"))
    verify_graph: bool = True  # CUDA: non-decode steps (verify, prefill) via the padded piecewise runner
    # Padded steps with no prefill chunk (verify spans, the DFlash drafts) as one CUDA graph per (rows, span),
    # attention included: the span attention kernel (kernels/decode_attention.span_attention: segments of <= span
    # rows, a per-row causal limit), metadata in fixed per-(rows, span) buffers (FlashInferAttention.plan_rows).
    # Needs decode_attention="triton". False: piecewise segments with FlashInfer's prefill eager between them (before).
    # Default from SPECBENCH_WHOLE_GRAPHS, else on.
    whole_graphs: bool = field(default_factory=lambda: _env("SPECBENCH_WHOLE_GRAPHS"))
    # Prefill-mixed steps whole too (engine/graphs.py `VerifyGraphs.run`): a step of the row ladder whose prefill
    # chunks hold at most this many tokens runs as one graph per ladder row count, every span (the chunks, the
    # decode and verify spans beside them) as segments of <= 16 rows of the span attention kernel, instead of the
    # piecewise segments with FlashInfer's prefill eager between them. Under load with staggered arrivals most
    # steps carry one new prompt (reports/h200-levers/2026-12-04-s2/: 12-30 ms such steps against ~4 ms decode
    # rounds at c64). The span kernel re-reads a sequence's keys once per 16 rows, so long chunks stay piecewise.
    # 0 = off (every prefill-mixed step piecewise, as before); needs whole_graphs and decode_attention="triton";
    # default from SPECBENCH_WHOLE_PREFILL, else 0 (not yet measured on the GPU).
    whole_prefill: int = field(default_factory=lambda: _env("SPECBENCH_WHOLE_PREFILL"))
    # Greedy DFlash drafts stay on the device from the draft pass to the verify forward (engine/spec/pending.py):
    # the host lays out the verify step while the draft runs and the verify runner copies the drafts into its input
    # rows on the device; the host reads them (pinned copy + event) just before the accept. Off with a fault armed.
    # False: the drafts are read to the host before the verify step is built (before). Default from
    # SPECBENCH_DEFER_DRAFTS, else on.
    defer_drafts: bool = field(default_factory=lambda: _env("SPECBENCH_DEFER_DRAFTS"))
    # Rows a prefill-mixed step of the padded runner is padded to (engine/graphs.py): "ladder" = the smallest
    # row count of a fixed ladder (16-row steps to 128, 32 to 256, 64 to 512, 128 beyond, up to
    # max_num_batched_tokens) that holds the step; "bucket" = batch bucket x span (before: a 391-row step of 63
    # decodes + one prompt ran 1024 rows, and a prompt chunk past bucket x span the eager plain forward).
    # Default from SPECBENCH_PADDED_ROWS, else ladder.
    padded_rows: str = field(default_factory=lambda: _env("SPECBENCH_PADDED_ROWS"))
    # The padded runner's fp32 logits: False = computed after the replay for the rows the step reads only (a
    # prefill chunk's rows are never projected to the vocabulary); True = inside the captured tail for every
    # padded row (before). Default from SPECBENCH_GRAPH_LOGITS, else off.
    graph_logits: bool = field(default_factory=lambda: _env("SPECBENCH_GRAPH_LOGITS"))
    draft_graph: bool = True  # CUDA: the DFlash draft through the padded piecewise runner (False: plain draft)
    # The DFlash drafter's context rows (fc + hidden_norm of the tapped features, each drafter layer's K/V at the
    # row's slot) written inside the target's captured step (decode graphs, padded verify runner) for every row,
    # so the commit only moves the context length: a one-token (gated) round then costs what a plain decode does
    # (issue 20). False: projected after the accept for the committed rows alone, eagerly (before). Rows past the
    # committed length hold context that is never read: the drafter attends to [0, committed) plus its own block,
    # and a position's row is rewritten by the step that commits it. Off while a self-test fault is armed.
    # Default from SPECBENCH_GRAPH_CONTEXT, else on.
    graph_context: bool = field(default_factory=lambda: _env("SPECBENCH_GRAPH_CONTEXT"))
    triton: bool = True  # Triton kernels on CUDA (also off with SPECBENCH_TRITON=0); CPU keeps torch
    # FlashInfer decode through its tensor-core (FA2 prefill) kernels instead of the CUDA-core decode kernel
    decode_tensor_cores: bool = True
    # Triton GEMVs (kernels/gemv.py) for the projections of steps of at most gemv.MAX_ROWS rows (decode), with
    # the residual add + RMSNorm fused in, where they measured faster than cuBLAS; cuBLAS elsewhere (default from
    # SPECBENCH_GEMV, else on)
    gemv: bool = field(default_factory=lambda: _env("SPECBENCH_GEMV"))
    # Tensor-core skinny GEMMs (kernels/skinny.py) with the same fusions for steps of 2..skinny.MAX_ROWS rows (a
    # request's verify span, batched decode) on the shapes where they measured faster than cuBLAS; needs `gemv`
    # (default from SPECBENCH_SKINNY, else OFF: opt-in until an engine-level GPU A/B shows a win, docs/gpu.md)
    skinny: bool = field(default_factory=lambda: _env("SPECBENCH_SKINNY"))
    # DFlash2's candidate-selector walk as one Triton launch per draft batch (kernels/selector_walk.py), in the
    # draft graph and the plain pass; False: the torch walk, a few ops per slot (default from
    # SPECBENCH_SELECTOR_KERNEL, else on; needs `triton` too)
    selector_kernel: bool = field(default_factory=lambda: _env("SPECBENCH_SELECTOR_KERNEL"))
    # Decode-only steps of the FlashInfer backend: "flashinfer" (its decode wrapper) or "triton" (the split-K
    # kernel of kernels/decode_attention.py, CUDA graphs included); prefill / verify steps stay on FlashInfer
    # (default from SPECBENCH_DECODE_ATTENTION, else "triton": faster in 9 of 10 measured cells, docs/gpu.md)
    decode_attention: str = field(default_factory=lambda: _env("SPECBENCH_DECODE_ATTENTION"))
    # Streamed text of unfinished requests in O(new tokens) per step (engine/detok.py); False decodes the whole
    # output every step (default from SPECBENCH_INCREMENTAL_DETOK, else on)
    incremental_detok: bool = field(default_factory=lambda: _env("SPECBENCH_INCREMENTAL_DETOK"))
    # add_request does not wait for a step in flight: the request is checked and left in an inbox the next step
    # takes in (engine.py; default from SPECBENCH_ADMIT_INBOX, else on; off: add_request takes the step lock)
    admit_inbox: bool = field(default_factory=lambda: _env("SPECBENCH_ADMIT_INBOX"))
    # Plain decode one step ahead (engine/ahead.py): the next decode step is launched before the host reads the
    # tokens of the one on the device, so the host's commit / schedule / metadata work overlaps the GPU's step
    # (CUDA graphs, no speculation; default from SPECBENCH_DECODE_AHEAD, else on)
    decode_ahead: bool = field(default_factory=lambda: _env("SPECBENCH_DECODE_AHEAD"))
    # Gated rounds one step ahead too (engine/ahead.py, issue 20): with speculation on, a step whose every
    # decode-phase request is held to one token (the gate or the automatic policy chose span 1; not-ready and
    # ineligible requests ride along) runs as a decode_ahead chain through the decode graphs that write the
    # drafter's context in the step (graph_context), so a gated round hides its host work as a plain decode
    # does. Needs decode_ahead and, for a drafter with tapped features, graph_context. Default from
    # SPECBENCH_GATED_AHEAD, else on.
    gated_ahead: bool = field(default_factory=lambda: _env("SPECBENCH_GATED_AHEAD"))
    # Reduction-order noise of a tensor-parallel engine, emulated on one device (docs/noise.md): with N > 1 each
    # row-parallel projection of the target (attention o_proj, MLP down_proj: the two a TP engine all-reduces) is N
    # partial GEMMs over N equal slices of its input dimension (o_proj at head boundaries), each rounded to the
    # model dtype as a TP rank's output is, summed last slice first (N = 2: second + first). Column-parallel GEMMs
    # (qkv, gate/up, lm_head) and the drafter are unchanged. 1 = off: the one-GEMM path, unchanged. Needs
    # num_attention_heads and intermediate_size divisible by N (checked when the model loads).
    tp_emulate: int = 1
    seed: int = 0
    spec: SpecConfig = field(default_factory=SpecConfig)
    faults: tuple[str, ...] = ()
    # Run-time invariants after every step (engine/invariants.py: pages per request, the pool's partition,
    # the drafter's context vs the committed length); a violation raises InvariantError. Default from
    # SPECBENCH_INVARIANTS (the tests set it), else off; gate commands turn it on (engine string invariants=1).
    check_invariants: bool = field(default_factory=lambda: _env("SPECBENCH_INVARIANTS"))
    trace_ranges: bool = False  # NVTX / record_function ranges around step phases (for profiling)
    # Prefix caching (engine/prefix_cache.py, docs/prefix-cache.md): full KV pages shared between requests with
    # the same token prefix, on by default (SPECBENCH_PREFIX_CACHE=0 turns the default off); prefix_cache_pages:
    # the most pages the cache indexes (None = the whole pool); spec_capture_cache_mb: the drafter's context rows
    # kept for cached blocks, in MiB (None = sized from the KV budget: every cached block; 0 = off: a warm request
    # decodes without drafts)
    prefix_cache: bool = field(default_factory=lambda: _env("SPECBENCH_PREFIX_CACHE"))
    prefix_cache_pages: int | None = None
    spec_capture_cache_mb: float | None = None

    def __post_init__(self) -> None:
        _need(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        _need(self.page_size >= 1 and (self.page_size & (self.page_size - 1)) == 0, "page_size",
              self.page_size, "a power of two")
        _need(self.num_pages is None or self.num_pages >= 1, "num_pages", self.num_pages, "null or >= 1")
        _need(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "an integer >= 1")
        _need(self.max_num_batched_tokens >= 16, "max_num_batched_tokens", self.max_num_batched_tokens,
              "an integer >= 16")
        _need(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", self.gpu_memory_utilization,
              "a number in (0, 1]")
        _need(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", self.attention_backend,
              _either(ATTENTION_BACKENDS))
        _need(self.prefix_cache_pages is None or (isinstance(self.prefix_cache_pages, int)
                                                  and not isinstance(self.prefix_cache_pages, bool)
                                                  and self.prefix_cache_pages >= 1),
              "prefix_cache_pages", self.prefix_cache_pages, "null or an integer >= 1 (at most num_pages)")
        mb = self.spec_capture_cache_mb
        _need(mb is None or (isinstance(mb, int | float) and not isinstance(mb, bool) and math.isfinite(mb) and mb >= 0),
              "spec_capture_cache_mb", mb, "null or a number >= 0 (0 = off)")
        _need(self.padded_rows in PADDED_ROWS, "padded_rows", self.padded_rows, f"one of {', '.join(PADDED_ROWS)}")
        _need(isinstance(self.whole_prefill, int) and not isinstance(self.whole_prefill, bool)
              and 0 <= self.whole_prefill <= self.max_num_batched_tokens, "whole_prefill", self.whole_prefill,
              f"an integer 0 (off) .. max_num_batched_tokens={self.max_num_batched_tokens}")
        _need(self.graph_runner in (None, True, False), "graph_runner", self.graph_runner,
              "null (CUDA only), true or false")
        _need(isinstance(self.tp_emulate, int) and not isinstance(self.tp_emulate, bool) and self.tp_emulate >= 1,
              "tp_emulate", self.tp_emulate, "an integer >= 1 (1 = off: one GEMM per projection)")
        _need(self.decode_attention in DECODE_ATTENTION, "decode_attention", self.decode_attention,
              _either(DECODE_ATTENTION))
        if isinstance(self.faults, list):
            object.__setattr__(self, "faults", tuple(self.faults))

    def with_(self, **kw: Any) -> EngineConfig:
        return replace(self, **kw)

    def describe(self) -> dict:
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.__dict__ if isinstance(v, SpecConfig) else v
        return out
