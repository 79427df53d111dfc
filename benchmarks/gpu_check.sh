#!/usr/bin/env bash
# Everything the course checks on a GPU, in one run that fits a 10-minute slot on one GPU
# (the steps' limits add up to 550 s; on an H200 they should take about half).
#
# Usage: bash benchmarks/gpu_check.sh [OUTDIR]        (OUTDIR defaults to $OUT, else gpu-check/)
#
# Steps, each with its own time limit so that one slow step cannot cost the others:
#   env       nvidia-smi and `attnlab doctor`
#   tests     tests/test_gpu.py: kernels natively compiled, against PyTorch, fp16/bf16/fp32
#   bench     benchmarks/gpu_attention.py: the README's GPU table (autotuned, with the winners)
#   lessons   lessons 05-08, then 00-04, executed as they are (benchmarks/run_lessons.py)
#   grade     the Triton exercises' solutions graded on the GPU (full marks expected)
# Each step's output goes to OUTDIR/<step>.txt and a line to OUTDIR/summary.txt; the executed
# lessons go to OUTDIR/lessons.tar.gz. Eight files at most, so that all of them come back from
# a device machine.
#
# The machine needs torch and triton with a GPU. The lessons also need nbclient, nbformat,
# ipykernel, ipywidgets and matplotlib; where they are missing (a bare GPU image), put their
# wheels in .whl/ (bash benchmarks/fetch_gpu_wheels.sh, where pip reaches PyPI; .whl/ is
# git-ignored, so send it along explicitly) and this script installs them into a temporary
# folder first.
set -u -o pipefail
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
py=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/attnlab-site .whl/*.whl \
        && export PYTHONPATH=/tmp/attnlab-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "== $name (at most $limit s)"
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    rc=$?
    tail -n 40 "$out/$name.txt"
    echo "$name: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
}

: >"$out/summary.txt"
step env 30 bash -c "nvidia-smi; $py -c 'import sys, torch, triton, numpy; print(sys.version); print(\"torch\", torch.__version__, \"triton\", triton.__version__, \"numpy\", numpy.__version__)'; $py -m attnlab doctor"
step tests 90 $py -m pytest -q -p no:cacheprovider -o addopts= tests/test_gpu.py
step bench 200 $py benchmarks/gpu_attention.py
lessons_dir=$(mktemp -d)
step lessons 150 $py benchmarks/run_lessons.py --out "$lessons_dir" --timeout 120 lessons/0[5-9]_*.ipynb lessons/0[0-4]_*.ipynb
tar czf "$out/lessons.tar.gz" -C "$lessons_dir" . 2>/dev/null
step grade 80 $py -m attnlab grade --cell-timeout 60 solutions/0[6-8]_*.ipynb
cat "$out/summary.txt"
