"""Foreign engines built and started by specbench itself, as subjects for the suites.

- `llamacpp`: llama.cpp's `llama-server` from the pinned `llama-cpp-python` sdist (build cache, GGUF
  fixtures, servers per speculation kind). `python -m specbench.harness.foreign.llamacpp --help`.
  Import its names from there; they live in `source` (pin, fetch, verify), `build` (cmake, cache, lock),
  `gguf` (conversion, drafters) and `server` (`LlamaServer`, `start_server`).
"""
