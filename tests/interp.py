"""Shared pieces of the kernel tests' Triton-interpreter subprocess scripts (TRITON_INTERPRET must be set
before triton is imported, hence a fresh interpreter): the prelude, and a torch attention backend that,
like FlashInfer, reads the K/V the fused rope kernel stored."""

from specbench.engine.attention.torch_ref import TorchAttention

PRELUDE = '''
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton.runtime.interpreter as ti

_orig = ti._patch_lang_tensor
def _patched(tensor, scope):  # numpy >= 2.4 refuses int() of a 1-element array
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
ti._patch_lang_tensor = _patched
'''


class StoredKV(TorchAttention):
    """The torch reference backend taking K/V from the cache when the model stored them itself."""

    accepts_stored_kv = True

    def plan(self, meta):
        super().plan(meta)
        self.slot_mapping = meta.slot_mapping

    def forward(self, q, k, v, kc, vc, scale):
        if k is None:
            k, v = kc[self.meta.slot_mapping], vc[self.meta.slot_mapping]
        return super().forward(q, k, v, kc, vc, scale)
