#!/usr/bin/env bash
# Download the wheels of benchmarks/gpu_wheels.txt into .whl/ for a GPU machine that cannot
# reach PyPI (x86-64 Linux, CPython 3.12 by default: PYVER=3.11 for another).
# .whl/ is git-ignored: send it along with the repository (it is about 33 MB), then run
# bash benchmarks/gpu_check.sh there.
set -euo pipefail
pyver=${PYVER:-3.12}
mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    plat+=(--platform "$p")
done
grep -v '^#' benchmarks/gpu_wheels.txt | grep -v '^$' | while read -r req; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
        "${plat[@]}" -d .whl "$req"
done
du -sh .whl
