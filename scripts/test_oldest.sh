#!/usr/bin/env bash
# `make test-oldest`: llmflow on the lowest torch and transformers it supports (pyproject.toml says
# why those two), in a venv of its own (.venv-oldest): dump capture and formats, compare, the
# bisection and the recipes end to end on tiny Llamas.
#
# Not part of `make test` (CI): PyPI has no CPU build of torch 2.1, so this installs its CUDA build
# with the nvidia-* libraries it loads at import (~2.5 GB to download, 4.7 GB on disk), which takes
# minutes before the tests (~2 min) start. Reruns reuse the venv.
# torch 2.1 has no float16 matmul on the CPU (torch 2.2 added it): tests running float16 models on
# the CPU are not in this subset; on an accelerator float16 runs on torch 2.1 as on any other.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_OLDEST=${TORCH_OLDEST:-2.1.2}
TRANSFORMERS_OLDEST=${TRANSFORMERS_OLDEST:-4.46.3}
VENV=${VENV_OLDEST:-.venv-oldest}

start=$(date +%s)
VENV=$VENV TORCH_SPEC="torch==$TORCH_OLDEST" EXTRAS=test ./scripts/install.sh
# install.sh holds transformers below 4.56 for this torch; take the lowest supported one exactly
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "transformers==$TRANSFORMERS_OLDEST"
echo "test-oldest: installed in $(( $(date +%s) - start )) s"
"$VENV/bin/python" -c 'import numpy, torch, transformers
print(f"test-oldest: torch {torch.__version__}, transformers {transformers.__version__}, numpy {numpy.__version__}")'

# test_kwargs_and_non_tensors_are_recorded: asserts the exact keyword arguments the Llama decoder
# layer of a recent transformers receives (use_cache, past_key_values); older ones pass others.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" \
  tests/unit/test_dump_*.py tests/unit/test_compare_*.py tests/unit/test_formats_*.py \
  tests/unit/test_localize_*.py tests/unit/test_stages_bisect.py tests/unit/test_workflow_*.py tests/unit/test_packaging_resources.py \
  tests/functional/test_dump_stage.py tests/functional/test_compare_dumps.py \
  tests/functional/test_workflow_recipes.py tests/functional/test_localize_faults.py \
  --deselect tests/unit/test_dump_capture.py::test_kwargs_and_non_tensors_are_recorded
