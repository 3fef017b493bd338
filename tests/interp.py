"""The Triton-interpreter prelude of the kernel tests' subprocess scripts (TRITON_INTERPRET must be set
before triton is imported, hence a fresh interpreter)."""

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
