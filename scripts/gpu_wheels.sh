#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has jax for CUDA, numpy, transformers, safetensors, orbax and pytest, and no
# network), downloaded here into wheels/ (git-ignored) for the device tool to carry; scripts/gpu_check.sh installs
# them when `import flax` fails there. About 4 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf wheels && mkdir wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
  -d wheels flax msgpack optax treescope rich markdown-it-py mdurl pygments absl-py PyYAML typing_extensions
ls wheels
