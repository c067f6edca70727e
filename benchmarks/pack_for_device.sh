#!/usr/bin/env bash
# Prepare what a device run needs, in ignored folders at the repo root (name both in the device tool's `carry`):
#   .snap/  a `git archive` of HEAD plus the test assets the GPU tests read (tokenizers, stories260K, text)
#   .whl/   wheels of the server's packages, which the GPU image lacks (fastapi, starlette, pydantic, uvicorn, ...), and pytest-timeout
# Then, on the device:
#   cd .snap && python3 -m pip install -q --no-index --no-deps --target /tmp/site ../.whl/*.whl &&
#   export PYTHONPATH=$PWD:/tmp/site HAYABUSA_ASSETS=$PWD/assets HAYABUSA_COMMIT=<sha> && bash benchmarks/device_run.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
ASSETS=${HAYABUSA_ASSETS:-../shared/assets}
for d in /.snap/ /.whl/; do grep -qx "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
rm -rf .snap && mkdir -p .snap/assets/models .snap/assets/tokenizers
git archive HEAD | tar -x -C .snap
cp -r "$ASSETS"/tokenizers/{qwen3,llm-jp-v3.1,llm-jp-v2.2,gpt2} .snap/assets/tokenizers/
cp -r "$ASSETS"/models/stories260K "$ASSETS"/models/stories260K-qwen2 .snap/assets/models/
cp -r "$ASSETS"/text .snap/assets/text
rm -f .snap/assets/models/stories260K/*.gguf .snap/assets/tokenizers/gpt2/*.gguf*
mkdir -p .whl
for pkg in fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 uvicorn==0.54.0 \
           annotated-types typing-inspection opentelemetry-api pytest-timeout; do   # (pytest-timeout: every test step has --timeout)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg"
done
du -sh .snap .whl
echo "commit: $(git rev-parse HEAD)"
