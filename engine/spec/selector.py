"""DFlash2's candidate selector: the draft path through the top-K candidates of each block slot.

Per request and draft slot j (1..S), the candidates are the top-K tokens of the drafter's logits at j and
their logits the unary scores. A transition from the token p chosen at slot j-1 (the verified anchor for
slot 1) to a candidate c at slot j scores
    edge(p -> c) = < A[p] * project(h_j), B[c] > + unary_j[c]
(A: predecessor codebook, B: successor codebook, project: the hidden projection of slot j's final hidden).
- `greedy_path`: at each slot the best-scoring candidate given the chosen predecessor (ties: the
  candidate with the higher logit, i.e. the earlier top-k entry);
- `sampled_path`: at each slot q_j = softmax(edge / T) over the K candidates given the token actually drawn
  at slot j-1, the draft drawn from q_j by inverse CDF with the request's uniform; `q_j` scattered over the
  vocabulary (zero off the candidates) is the draft distribution rejection sampling must use: the verify
  checks d_j against p_j(. | prefix) with exactly this q_j, and when d_1..d_{j-1} are accepted the prefix the
  target saw is the one q_j was conditioned on, so the emitted tokens are distributed as the target's
  (engine/spec/sampling.py). A q from the unselected logits would make the verify lossy.
The walk is sequential in j (S = B - 1 small steps) and batched over requests: here one set of ops per slot
(the reference); with `kernel=True` (`kernel_on`: CUDA, Triton on, EngineConfig.selector_kernel) the whole
batch walks in one launch (kernels/selector_walk.py): the same scores up to the fp32 order of the rank sum,
the same choices but at fp32 near ties, q to fp32 rounding (tests/selector_walk_cases.py).
The top-K over the vocabulary is torch.topk, or FlashInfer's radix kernel with SPECBENCH_FLASHINFER_TOPK=1.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specbench import env
from specbench.kernels import triton_enabled

TOPK_ENV = "SPECBENCH_FLASHINFER_TOPK"  # 1: FlashInfer's radix top-k on CUDA where it exists (off by default)


@functools.cache
def _flashinfer_topk():
    """flashinfer.top_k when switched on, importable and present (0.5.3 may lack it), else None. Off by
    default until tests/gpu/test_dflash2_gpu.py has shown it capture-safe and equal to torch.topk there."""
    if not env.flag(TOPK_ENV):
        return None
    try:
        import flashinfer  # noqa: PLC0415
    except ImportError:
        return None
    return getattr(flashinfer, "top_k", None)


def kernel_on(device: torch.device | str, selector_kernel: bool, triton: bool) -> bool:
    """Whether the walk runs as the one-launch kernel: `selector_kernel` (EngineConfig.selector_kernel) and the
    Triton kernels enabled for `device` (CUDA with `triton`, or the Triton interpreter in tests)."""
    return selector_kernel and triton_enabled(device, triton)


def candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, S, V] -> (unary [N, S, K] fp32, candidate ids [N, S, K]), descending by logit."""
    x = logits.float()
    fi = _flashinfer_topk() if x.is_cuda else None
    if fi is not None:
        v, i = fi(x.reshape(-1, x.shape[-1]), k, sorted=True)
        return v.view(*x.shape[:-1], k), i.view(*x.shape[:-1], k).long()
    unary, ids = torch.topk(x, k, dim=-1, sorted=True)
    return unary, ids


def _edge(unary_j: torch.Tensor, ids_j: torch.Tensor, proj_j: torch.Tensor, prev: torch.Tensor,
          pred: torch.Tensor, succ: torch.Tensor) -> torch.Tensor:
    """Scores [N, K] of slot j's candidates given predecessors prev [N]."""
    a = F.embedding(prev, pred).float() * proj_j  # [N, R]
    b = F.embedding(ids_j, succ).float()  # [N, K, R]
    return unary_j + torch.einsum("nr,nkr->nk", a, b)


def project(hidden: torch.Tensor, proj_w: torch.Tensor) -> torch.Tensor:
    """Final-normed slot hidden [N, S, H] -> project(h) [N, S, R] fp32."""
    return F.linear(hidden, proj_w).float()


def greedy_path(unary: torch.Tensor, ids: torch.Tensor, proj: torch.Tensor, anchor: torch.Tensor,
                pred: torch.Tensor, succ: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """The best path from the anchors [N]: draft ids [N, S]. `kernel`: in one launch (kernels/selector_walk.py)."""
    if kernel:
        from specbench.kernels.selector_walk import selector_walk  # noqa: PLC0415  (imports triton)

        return selector_walk(unary, ids, proj, anchor, pred, succ)[0]
    prev, path = anchor, []
    for j in range(ids.shape[1]):
        s = _edge(unary[:, j], ids[:, j], proj[:, j], prev, pred, succ)
        prev = ids[:, j].gather(1, s.argmax(-1, keepdim=True))[:, 0]
        path.append(prev)
    return torch.stack(path, dim=1)


def sampled_path(unary: torch.Tensor, ids: torch.Tensor, proj: torch.Tensor, anchor: torch.Tensor,
                 pred: torch.Tensor, succ: torch.Tensor, temps: torch.Tensor, u: torch.Tensor,
                 vocab: int, kernel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A path drawn by inverse CDF: temps [N] (> 0), u [N, S] uniforms in [0, 1). Returns (drafts [N, S],
    q [N, S, V]: each slot's draft distribution over the vocabulary, given the drawn predecessor).
    `kernel`: the walk in one launch (kernels/selector_walk.py), q scattered over the vocabulary after it."""
    n, slots, k = ids.shape
    if kernel:
        from specbench.kernels.selector_walk import selector_walk  # noqa: PLC0415  (imports triton)

        drafts, qk = selector_walk(unary, ids, proj, anchor, pred, succ, temps, u)
        assert qk is not None
        return drafts, torch.zeros(n, slots, vocab, device=qk.device, dtype=torch.float32).scatter_(2, ids.long(), qk)
    prev, path, qs = anchor, [], []
    for j in range(slots):
        s = _edge(unary[:, j], ids[:, j], proj[:, j], prev, pred, succ)
        q = torch.softmax(s / temps[:, None], dim=-1)  # [N, K]
        cdf = q.cumsum(-1)
        idx = torch.searchsorted(cdf, (u[:, j] * cdf[:, -1])[:, None], right=True).clamp(max=k - 1)
        prev = ids[:, j].gather(1, idx)[:, 0]
        path.append(prev)
        qs.append(torch.zeros(n, vocab, device=q.device, dtype=torch.float32).scatter_(1, ids[:, j], q))
    return torch.stack(path, dim=1), torch.stack(qs, dim=1)
