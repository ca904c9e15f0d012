#!/usr/bin/env bash
# Interop suite (docs/interop.md): real google-tunix 0.1.7 writes checkpoints, this library
# converts them, real maxtext 0.2.5 reads them; plus the core suite (without the reliability
# suite, which .ci/run runs once) at the newest and at the oldest orbax-checkpoint this
# package declares (pyproject's lower bound).
#
# Venvs are built from constraints/interop.txt (exact pins, installed --no-deps) under
#   ${ORBAX_MAXTEXT_LAYOUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/orbax-maxtext-layout}/
# named by a hash of their pins and Python version, and reused while that hash matches. A
# fresh machine builds them from scratch. Python 3.12 comes from pyenv (maxtext needs it);
# set INTEROP_PYTHON=/path/to/python3.12 to use another interpreter.
#
# The hf venv (constraints/hf.txt: transformers with the CPU build of torch 2.13.0 that lies on
# this machine's disk for Python 3.11 only) is built the same way from Python 3.11 (pyenv's
# newest 3.11.x, else python3 if it is 3.11; INTEROP_HF_PYTHON=/path/to/python3.11 overrides)
# and its python is exported to the interop suite as OMTL_HF_PYTHON, for
# tests/interop/test_export_hf_logits.py (which skips without it).
#
# Usage: .ci/interop.sh [--no-core | --oldest-core]
#        (--no-core: interop tests only; --oldest-core: of the two core runs, only the one at
#        the oldest orbax-checkpoint, as .ci/run calls it: its own core run has the newest)
#        INTEROP_OLDEST_ORBAX=0.12.5 .ci/interop.sh   (core suite at a candidate lower bound)
# Exits non-zero if a venv cannot be built or any test run fails.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
CONSTRAINTS="$REPO/constraints/interop.txt"
HF_CONSTRAINTS="$REPO/constraints/hf.txt"
CACHE_ROOT="${ORBAX_MAXTEXT_LAYOUT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/orbax-maxtext-layout}"
RECIPE=1 # bump to invalidate every cached venv (change of build steps, not of pins)
RUN_CORE=1
RUN_NEWEST_CORE=1
[[ "${1:-}" == "--no-core" ]] && RUN_CORE=0
[[ "${1:-}" == "--oldest-core" ]] && RUN_NEWEST_CORE=0

log() { printf '== [interop %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf 'interop.sh: error: %s\n' "$*" >&2; exit 2; }

find_python312() {
  if [[ -n "${INTEROP_PYTHON:-}" ]]; then
    echo "$INTEROP_PYTHON"
    return
  fi
  command -v pyenv >/dev/null 2>&1 || die "pyenv not found and INTEROP_PYTHON not set; Python 3.12 is required (maxtext 0.2.5)"
  local version
  version="$(pyenv versions --bare | tr -d ' *' | grep -E '^3\.12\.[0-9]+$' | sort -V | tail -n 1 || true)"
  [[ -n "$version" ]] || die "pyenv has no 3.12.x (pyenv versions --bare); install one or set INTEROP_PYTHON"
  PYENV_VERSION="$version" pyenv which python3.12
}

find_python311() {
  if [[ -n "${INTEROP_HF_PYTHON:-}" ]]; then
    echo "$INTEROP_HF_PYTHON"
    return
  fi
  local version=""
  if command -v pyenv >/dev/null 2>&1; then
    version="$(pyenv versions --bare | tr -d ' *' | grep -E '^3\.11\.[0-9]+$' | sort -V | tail -n 1 || true)"
  fi
  if [[ -n "$version" ]]; then
    PYENV_VERSION="$version" pyenv which python3.11
  elif python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
    command -v python3
  else
    die "no Python 3.11 (pyenv versions --bare, python3) for the hf venv; set INTEROP_HF_PYTHON"
  fi
}

# build_venv NAME REQUIREMENTS_FILE -> prints the venv path. Reuses a complete venv of the
# same hash; a half-built one (no stamp) is removed and built again.
build_venv() {
  local name="$1" reqs="$2" py="$3" key dir
  key="$( { echo "recipe=$RECIPE"; "$py" -c 'import sys; print(sys.version)'; cat "$reqs"; } \
    | sha256sum | cut -c1-16)"
  dir="$CACHE_ROOT/$name-$key"
  if [[ -f "$dir/.complete" ]]; then
    log "reusing $dir" >&2
    echo "$dir"
    return
  fi
  mkdir -p "$CACHE_ROOT"
  rm -rf "$dir"
  log "building $dir (from $(basename "$reqs"), $("$py" -V 2>&1))" >&2
  "$py" -m venv "$dir" >&2
  # pip's log goes to a file (this machine's pip config adds noisy per-package warnings);
  # it is shown only if the install fails.
  if ! "$dir/bin/python" -m pip install -q --no-deps --no-input -r "$reqs" >"$dir/pip-install.log" 2>&1; then
    grep -v "^WARNING: Location 'file:" "$dir/pip-install.log" >&2 || true
    die "pip install into $dir failed (log above; the venv is left incomplete and rebuilt next run)"
  fi
  touch "$dir/.complete"
  echo "$dir"
}

# install_repo VENV: this checkout, editable and without dependencies (the pins provide
# them), re-pointed on every run so a reused venv always tests the tree it is run from.
install_repo() {
  "$1/bin/python" -m pip install -q --no-deps --no-build-isolation --no-input -e "$REPO" \
    2> >(grep -v "^WARNING: Location 'file:" >&2) >/dev/null
  "$1/bin/python" - "$REPO" <<'PY'
import pathlib, sys
import orbax_maxtext_layout as m
here = pathlib.Path(m.__file__).resolve()
assert here.is_relative_to(pathlib.Path(sys.argv[1]).resolve()), f"imports {here}, not this checkout"
PY
}

pytest_in() { # pytest_in VENV ARGS...: from the repo root, no cache writes
  local venv="$1"
  shift
  (cd "$REPO" && "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@")
}

[[ -f "$CONSTRAINTS" ]] || die "$CONSTRAINTS missing"
[[ -f "$HF_CONSTRAINTS" ]] || die "$HF_CONSTRAINTS missing"
PY312="$(find_python312)"
[[ -x "$PY312" ]] || die "no Python 3.12 interpreter at '$PY312'"
"$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' \
  || die "$PY312 is not Python 3.12"
PY311="$(find_python311)"
[[ -x "$PY311" ]] || die "no Python 3.11 interpreter at '$PY311'"
"$PY311" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' \
  || die "$PY311 is not Python 3.11 (the CPU torch on disk is for 3.11 only)"

START=$SECONDS
status=0

# -- 1. interop venv: the full pin set ------------------------------------------------------
INTEROP_VENV="$(build_venv interop-venv "$CONSTRAINTS" "$PY312")"
install_repo "$INTEROP_VENV"
"$INTEROP_VENV/bin/python" -c 'import tunix.sft.checkpoint_manager, maxtext.common.checkpointing' \
  2>/dev/null || die "the interop venv cannot import tunix.sft.checkpoint_manager / maxtext.common.checkpointing"
log "versions: $("$INTEROP_VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(orbax-checkpoint|jax|flax|optax|google-tunix|maxtext)==' | tr '\n' ' ')"

# -- 1b. hf venv: transformers + CPU torch + PEFT, for export-hf's output (and --adapter's) --
HF_VENV="$(build_venv hf-venv "$HF_CONSTRAINTS" "$PY311")"
"$HF_VENV/bin/python" -c 'import torch, transformers, safetensors, peft' 2>/dev/null \
  || die "the hf venv cannot import torch / transformers / safetensors / peft"
log "hf venv: $("$HF_VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(torch|transformers|safetensors|tokenizers|peft)==' | tr '\n' ' ')"
export OMTL_HF_PYTHON="$HF_VENV/bin/python"

log "interop suite (python -m pytest -q tests/interop), OMTL_HF_PYTHON=$OMTL_HF_PYTHON"
# The gs:// tests that need MaxText (export-hf to and from a bucket) run here, beside the
# interop suite; the rest of tests/gcs runs in .ci/run's own core pass. Like every pass here
# it runs on pyproject's pytest-xdist workers (-n auto), by file (--dist loadfile): each
# module's MaxText and Tunix fixtures are built once, on the worker that runs its tests.
pytest_in "$INTEROP_VENV" --dist loadfile tests/interop tests/gcs/test_gcs_export_hf.py tests/gcs/test_gcs_import_hf.py || status=1

if [[ "$RUN_CORE" == 1 ]]; then
  # -- 2. core suite at the newest pinned orbax-checkpoint (the interop venv) ---------------
  NEWEST="$(sed -nE 's/^orbax-checkpoint==([^ ]+).*/\1/p' "$CONSTRAINTS")"
  if [[ "$RUN_NEWEST_CORE" == 1 ]]; then
    log "core suite, orbax-checkpoint $NEWEST (newest pinned)"
    pytest_in "$INTEROP_VENV" --ignore=tests/interop --ignore=tests/reliability --ignore=tests/gcs tests \
      || status=1
  else
    log "core suite at orbax-checkpoint $NEWEST (newest pinned): left to the caller's own core run"
  fi

  # -- 3. core suite at the oldest orbax-checkpoint pyproject declares ----------------------
  # INTEROP_OLDEST_ORBAX=X tries a lower bound before pyproject.toml declares it.
  OLDEST_FROM="oldest declared in pyproject.toml"
  OLDEST="$(sed -nE 's/.*"orbax-checkpoint *>= *([0-9][0-9.]*)[",].*/\1/p' pyproject.toml | head -n 1)"
  [[ -n "$OLDEST" ]] || die "no 'orbax-checkpoint>=X' lower bound found in pyproject.toml"
  if [[ -n "${INTEROP_OLDEST_ORBAX:-}" ]]; then
    OLDEST="$INTEROP_OLDEST_ORBAX"
    OLDEST_FROM="candidate lower bound from INTEROP_OLDEST_ORBAX"
  fi
  if [[ "$OLDEST" == "$NEWEST" ]]; then
    log "oldest declared orbax-checkpoint ($OLDEST) is the newest pinned: covered by step 2"
  else
    OLDEST_REQS="$(mktemp)"
    trap 'rm -f "$OLDEST_REQS"' EXIT
    grep -E '# core' "$CONSTRAINTS" | sed -E "s/^orbax-checkpoint==[^ ]+/orbax-checkpoint==$OLDEST/" >"$OLDEST_REQS"
    OLDEST_VENV="$(build_venv core-orbax-oldest-venv "$OLDEST_REQS" "$PY312")"
    install_repo "$OLDEST_VENV"
    log "core suite, orbax-checkpoint $OLDEST ($OLDEST_FROM)"
    pytest_in "$OLDEST_VENV" --ignore=tests/interop --ignore=tests/reliability --ignore=tests/gcs tests \
      || status=1
  fi
fi

log "done in $((SECONDS - START)) s, status $status"
exit "$status"
