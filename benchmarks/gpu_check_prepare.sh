#!/usr/bin/env bash
# Run HERE (a machine with PyPI), once, before the device call of benchmarks/gpu_check.py.
#
# The GPU machine has Python 3.12, torch and transformers, but no megatron-core and no network.
# This fetches megatron-core 0.16.1's wheel for CPython 3.12 / x86-64 into <repo>/gpu_wheels/
# (ignored by git), which the device call carries and installs (benchmarks/README.md has the
# exact command). Its dependencies (torch, numpy, packaging) are already on that machine.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/gpu_wheels"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
LIMIT_BYTES=$((16 << 20))  # what travels is capped at 64 MiB; the wheel is ~2.6 MB

mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "megatron-core==0.16.1"

shopt -s nullglob
wheels=("$DEST"/megatron_core-0.16.1-cp312-*.whl)
if [ "${#wheels[@]}" -ne 1 ]; then
    echo "expected exactly one megatron_core-0.16.1 cp312 wheel in $DEST, found ${#wheels[@]}" >&2
    exit 1
fi
total=$(du -cb "$DEST" | tail -1 | cut -f1)
if [ "$total" -gt "$LIMIT_BYTES" ]; then
    echo "$DEST holds $total bytes: more than the $LIMIT_BYTES this script allows to carry" >&2
    exit 1
fi
echo "ready: ${wheels[0]#"$ROOT"/} ($total bytes in gpu_wheels/); carry [\"gpu_wheels\"]"
