"""Kernel classes: one ordered rule table, regex -> class, first match wins.

Contract:
- `RULES` is the whole built-in classification, in order. A rule's regex is searched
  (case-insensitively) in the activity's full name: the demangled kernel name (template arguments
  included, which is how a PyTorch `vectorized_elementwise_kernel<..., silu_kernel...>` is known to be
  an activation), or the memcpy/memset/graph label the reader wrote.
- Order encodes precedence: specific before generic. Communication before everything (NCCL names say
  "Reduce"); KV copy before attention ("reshape_and_cache_flash"); sampling before gather
  ("gatherTopK") and before elementwise ("reduce_kernel<ArgMaxOps>"); norms before GEMM
  ("cudnn::bn_fw"); attention before GEMM (FlashAttention-3 is a "cutlass::device_kernel"); GEMM before
  activation ("scudnn_128x64_relu"); RoPE before embedding ("rotary_embedding").
- User rules (`load_rules`, `--rules FILE`) go BEFORE the built-ins, so they can override any of them
  and add new class names.
- No name is unclassified: the fallback class is "other".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

from .trace import GapsError

OTHER = "other"

# (regex, class). Kept as plain data so docs/gaps.md and `--help` can show it verbatim.
RULES: tuple[tuple[str, str], ...] = (
    (r"^\[?(cuda )?mem(cpy|set)\b", "memcpy/memset"),
    (r"^cuda graph\b", "CUDA graph (opaque)"),
    (r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|cross_device_reduce|sendrecv", "communication"),
    (r"reshape_and_cache|concat_and_cache|store_?kv|append_?paged_?kv|kv_?cache_?(copy|write|store|append|update)"
     r"|copy_?(to_)?kv|write_?kv", "KV copy"),
    (r"argmax|argmin|(?<![a-z])top_?[kp](?![a-z])|topk|topp|sampling|(?<!up)(?<!down)sampl|multinomial|gumbel"
     r"|radix_?sort|bitonic_?sort|sortkeyvalue|segmented_?sort|distribution_|philox|curand", "sampling/argmax/top-k"),
    (r"rotary|(?<![a-z])rope|rope(?![a-z])", "RoPE"),
    (r"rms_?norm|layer_?norm|group_?norm|batch_?norm|instance_?norm|rowwisemoments|(?<![a-z])norm_kernel"
     r"|bn_fw|bn_bw|welford", "RMSNorm/LayerNorm"),
    (r"flash_?(fwd|bwd|attn|decode|prefill)|flash::|flashattn|fmha|attention|attn|prefill|batchdecode"
     r"|singledecode|merge_?state|softmax|sdpa|(?<![a-z])mha", "attention"),
    (r"gemm|gemv|nvjet|cutlass|cublas|xmma|matmul|wgmma|(?<![a-z])mm_|_mm(?![a-z])|bmm|addmm|scudnn"
     r"|convolve|conv2d|winograd|implicit_|split_?k|cudnn|dot_kernel|fft2d", "GEMM"),
    (r"silu|swiglu|gelu|relu|act_and_mul|sigmoid|tanh|swish|(?<![a-z])glu|softplus|threshold", "activation/SwiGLU"),
    (r"embedding|index_?select|gather|index_kernel|index_elementwise|scatter|index_put|take_kernel", "embedding/gather"),
    (r"elementwise|functor|_add|add_|mul_|copy|fill|triton_(poi|per|red)_|reduce_kernel|where_kernel|compare"
     r"|cat_?array|pointwise|multi_tensor_apply|clamp|dropout", "residual add/elementwise"),
)

CLASSES: tuple[str, ...] = (
    "GEMM", "attention", "RMSNorm/LayerNorm", "RoPE", "activation/SwiGLU", "residual add/elementwise",
    "embedding/gather", "KV copy", "sampling/argmax/top-k", "memcpy/memset", "communication",
    "CUDA graph (opaque)", OTHER,
)


@dataclass(frozen=True)
class Classifier:
    """An ordered rule list with a memo; build with `Classifier.build(extra_rules)`."""

    rules: tuple[tuple[str, str], ...]

    @staticmethod
    def build(extra: list[tuple[str, str]] | None = None) -> Classifier:
        rules = tuple(extra or ()) + RULES
        for pattern, cls in rules:
            _compile(pattern, cls)
        return Classifier(rules)

    def __call__(self, name: str) -> str:
        return _classify(self.rules, name)

    def classes(self) -> list[str]:
        """Every class this classifier can return, built-ins in their canonical order first."""
        extra = [c for _, c in self.rules if c not in CLASSES]
        return list(dict.fromkeys(extra)) + list(CLASSES)


@cache
def _compile(pattern: str, cls: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise GapsError(f"rule for class {cls!r}: bad regex {pattern!r}: {e}") from e


@lru_cache(maxsize=65536)
def _classify(rules: tuple[tuple[str, str], ...], name: str) -> str:
    for pattern, cls in rules:
        if _compile(pattern, cls).search(name):
            return cls
    return OTHER


def classify(name: str) -> str:
    """Class of `name` under the built-in rules."""
    return _classify(RULES, name)


def load_rules(path: Path) -> list[tuple[str, str]]:
    """Extra rules from a text file: one `regex,class` per line (split at the LAST comma, so the regex
    may contain commas); blank lines and lines starting with # are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise GapsError(f"--rules {path}: cannot read it ({e.strerror or e})") from e
    rules: list[tuple[str, str]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pattern, sep, cls = line.rpartition(",")
        pattern, cls = pattern.strip(), cls.strip()
        if not sep or not pattern or not cls:
            raise GapsError(f"--rules {path}:{lineno}: expected 'regex,class', got {raw!r}")
        try:
            re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise GapsError(f"--rules {path}:{lineno}: bad regex {pattern!r}: {e}") from e
        rules.append((pattern, cls))
    return rules
