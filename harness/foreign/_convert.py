"""Run llama.cpp's vendored `convert_hf_to_gguf.py` with two overrides, patched at import time.

    python -m specbench.harness.foreign._convert --llama-src DIR [--force-pre qwen2] -- <convert args>

The vendored script is never edited. Before it runs, this wrapper puts DIR and DIR/gguf-py first on
sys.path, imports the script's own `conversion` package and patches two methods of its `TextModel`:

- `get_vocab_base_pre` returns the `--force-pre` name (the tiny fixture tokenizer is a Qwen2-style
  byte-level BPE whose check-hash llama.cpp does not know, so it would raise "BPE pre-tokenizer was
  not recognized");
- `_set_vocab_sentencepiece` raises FileNotFoundError when `sentencepiece` is not importable or the
  model has no `tokenizer.model`, which is what `Qwen2Model.set_vocab` catches to fall back to the
  GPT-2 (BPE) vocabulary; unpatched it raises ImportError first when `sentencepiece` is missing.

Then the script runs as `__main__` with the remaining arguments. Nothing here imports specbench, so it
runs under any interpreter that has numpy, torch, safetensors, pyyaml.
"""

from __future__ import annotations

import argparse
import importlib.util
import runpy
import sys
from pathlib import Path


def _patch(force_pre: str | None) -> None:
    from conversion import base  # the vendored package, found through sys.path

    text_model = base.TextModel
    if force_pre:
        def get_vocab_base_pre(self, tokenizer) -> str:  # noqa: ARG001 - same signature as upstream
            base.logger.info(f"specbench: BPE pre-tokenizer forced to {force_pre!r}")
            return force_pre

        text_model.get_vocab_base_pre = get_vocab_base_pre

    original_sp = text_model._set_vocab_sentencepiece

    def _set_vocab_sentencepiece(self, *args, **kwargs):
        if importlib.util.find_spec("sentencepiece") is None:
            raise FileNotFoundError("specbench: sentencepiece is not installed; using the BPE vocabulary")
        if not (Path(self.dir_model) / "tokenizer.model").is_file():
            raise FileNotFoundError(f"specbench: no tokenizer.model in {self.dir_model}")
        return original_sp(self, *args, **kwargs)

    text_model._set_vocab_sentencepiece = _set_vocab_sentencepiece


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="specbench.harness.foreign._convert")
    ap.add_argument("--llama-src", required=True, type=Path, help="the vendored llama.cpp tree")
    ap.add_argument("--force-pre", default=None, help="declare this BPE pre-tokenizer (e.g. qwen2)")
    args = ap.parse_args(argv)
    src = args.llama_src.resolve()
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"no {script}")
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    _patch(args.force_pre)
    sys.argv = [str(script), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
