#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one command, for a machine where torch sees one:
#   1. the CUDA tests (tests/functional/test_cuda_paths.py), first: a short lease still runs them;
#   2. the dump benchmark on SmolLM2's shapes: held tensors against copies, and the writer thread
#      against inline, side by side (and, with BASELINE=DIR, the llmflow checkout in DIR timed in
#      the same run);
#   3. where the module dumps' time goes (benchmarks/profile_dump.py), and what each per-tensor
#      step of the capture costs (benchmarks/bench_cuda_capture_costs.py);
#   4. msprobe's dumps at the module level beside llmflow's, where msprobe imports.
# Usage: benchmarks/gpu_checks.sh [OUTDIR]    (PYTHON=python3 by default; logs and tables in OUTDIR)
# Runs from this checkout without installing it; PYTHON must import torch with CUDA, llmflow's
# dependencies (pyyaml, jsonschema, numpy, rich, openpyxl, safetensors, transformers, orjson,
# jinja2) and, for step 3, mindstudio-probe.
# Each step has its own time limit (seconds: BENCH_S, TESTS_S, MSPROBE_S), so a short lease still
# brings back what finished. STEPS names the steps to run (default all: tests copies writers
# baseline profile costs msprobe); the baseline step times DIR's own benchmarks/bench_dump.py
# where DIR has one (an older checkout's script matches its own llmflow).
set -u
out=${1:-gpu-checks}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
here=$PWD
with_path() { PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" "${@:2}"; }
bench=(benchmarks/bench_dump.py --device cuda --models smollm2-shape)
steps=" ${STEPS:-tests copies writers baseline profile costs msprobe} "
want() { [[ $steps == *" $1 "* ]]; }

"$py" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee "$out/env.txt"
with_path "$here" "$py" -m llmflow.native 2>&1 | tail -3 | tee -a "$out/env.txt"

workers=$("$py" -c 'import xdist' 2>/dev/null && echo "-n 4")  # (pytest-xdist where it is installed)
want tests && with_path "$here" timeout "${TESTS_S:-150}" "$py" -m pytest -q -p no:cacheprovider \
    $workers tests/functional/test_cuda_paths.py 2>&1 | tee "$out/cuda_tests.log" | tail -15
want copies && with_path "$here" timeout "${BENCH_S:-150}" "$py" "${bench[@]}" --copies auto always \
    --repeat 3 2>&1 | tee "$out/bench_dump.md"
want writers && with_path "$here" timeout "${BENCH_S:-150}" "$py" "${bench[@]}" --writer thread inline \
    --repeat 3 --modes "statistics module" "tensor module" 2>&1 | tee "$out/bench_dump_writers.md"
if want baseline && [ -n "${BASELINE:-}" ]; then
    script=$BASELINE/benchmarks/bench_dump.py
    [ -f "$script" ] || script=${bench[0]}
    echo "## baseline: $BASELINE ($script)" | tee "$out/bench_dump_baseline.md"
    with_path "$BASELINE" timeout "${BENCH_S:-150}" "$py" "$script" "${bench[@]:1}" --writer thread inline \
        --repeat 3 --modes "statistics module" "tensor module" 2>&1 | tee -a "$out/bench_dump_baseline.md"
fi
want profile && { with_path "$here" timeout "${BENCH_S:-150}" "$py" benchmarks/profile_dump.py \
    --device cuda --models smollm2-shape --top 40 > "$out/profile.md" 2>&1
    grep -A7 '^| part' "$out/profile.md"; }
want costs && with_path "$here" timeout 120 "$py" benchmarks/bench_cuda_capture_costs.py 2>&1 \
    | tee "$out/capture_costs.md"
want msprobe && with_path "$here" timeout "${MSPROBE_S:-150}" "$py" "${bench[@]}" --msprobe --repeat 1 \
    --modes "statistics module" "tensor module" 2>&1 | tee "$out/bench_dump_msprobe.md"
