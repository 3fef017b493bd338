#!/usr/bin/env bash
# Wheels the GPU machine lacks for `specbench eval` / `specbench serve` (scripts/gpu.sh eval installs them):
# lm-eval 0.4.13 and what it imports that the device image does not have, the FastAPI server stack, tenacity.
# lm-eval's wheel is slimmed to the gsm8k task folder (its 200+ task folders are 9 MB; specbench runs only
# its own bundled task YAMLs) so that the carried tree stays under the device's 64 MiB limit.
# Usage (here, in the repo root, with the project's venv):  bash scripts/fetch-eval-wheels.sh [.whl-eval]
set -euo pipefail
dest=${1:-.whl-eval}
pip=${PIP:-.venv/bin/pip}
mkdir -p "$dest"
$pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  lm_eval==0.4.13 datasets==5.2.0 dill==0.4.1 evaluate==0.4.6 more-itertools==11.2.1 multiprocess==0.70.19 \
  nltk==3.10.4 pathvalidate==3.3.1 pydantic==2.14.4 pydantic_core==2.50.5 pytablewriter==1.2.1 \
  DataProperty==1.1.1 mbstrdecoder==1.1.5 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 \
  starlette==1.10.0 fastapi==0.165.0 uvicorn==0.54.0 annotated-types==0.8.0 typing-inspection==0.4.5 \
  opentelemetry-api==1.45.2 tenacity==9.2.1
$pip wheel -q --no-deps -w "$dest" rouge_score==0.1.2 sqlitedict==2.1.0 word2number==1.1  # sdist-only
whl=$(cd "$dest" && pwd)/$(basename "$(ls "$dest"/lm_eval-0.4.13-*.whl)")
tmp=$(mktemp -d)
python3 -m zipfile -e "$whl" "$tmp"
for d in "$tmp"/lm_eval/tasks/*/; do [ "$(basename "$d")" = gsm8k ] || rm -rf "$d"; done
rm -f "$whl"
(cd "$tmp" && python3 - "$whl" <<'PY'
import pathlib, sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w", zipfile.ZIP_DEFLATED) as z:
    for p in sorted(pathlib.Path(".").rglob("*")):
        if p.is_file():
            z.write(p, str(p))
PY
)
rm -rf "$tmp"
du -sh "$dest"
