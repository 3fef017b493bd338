"""Foreign engines built and started by specbench itself, as subjects for the suites.

- `llamacpp`: llama.cpp's `llama-server` from the pinned `llama-cpp-python` sdist (build cache, GGUF
  fixtures, servers per speculation kind). `python -m specbench.harness.foreign.llamacpp --help`.
"""
