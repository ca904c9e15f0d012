#!/usr/bin/env bash
# The core suite on a TPU host (issue 57), in one process with JAX's default backend on the
# chip, in three parts of under 10 minutes each (the device tool's limit a command), plus about
# 40 s of installing on a fresh host:
#
#   bash .ci/tpu.sh 1      # tests/reliability, tests/gcs, tests/test_[a-g]*.py
#   bash .ci/tpu.sh 2      # tests/test_[h-q]*.py
#   bash .ci/tpu.sh 3      # tests/test_[r-z]*.py
#
# Installs what the host lacks under /tmp/site first (once per machine): orbax-checkpoint,
# flax and tensorstore from wheels in .whl-tpu (docs/design.md, "On an accelerator host",
# says how to download them), the rest from the host's own index. Never CI: CI has no chip.
set -uo pipefail
cd "$(dirname "$0")/.."
part="${1:?part 1, 2 or 3}"
if [ ! -f /tmp/site/.done ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --find-links .whl-tpu --target /tmp/site \
    orbax-checkpoint==0.12.8 flax==0.12.8 tensorstore==0.1.86 zstandard threadpoolctl optax \
    safetensors ml_dtypes 2>&1 | grep -v "^\[notice\]" && touch /tmp/site/.done
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD"
case "$part" in
  1) files=(tests/reliability tests/gcs tests/test_[a-g]*.py) ;;
  2) files=(tests/test_[h-q]*.py) ;;
  3) files=(tests/test_[r-z]*.py) ;;
  *) echo "part 1, 2 or 3" >&2; exit 2 ;;
esac
# -o addopts: no xdist workers (only one process may hold the chip); not slow, not interop
PYTHONUNBUFFERED=1 exec python3 -m pytest -q -o addopts="" -p no:cacheprovider -ra \
  -m "not slow" --ignore=tests/interop --durations=10 "${files[@]}"
