#!/usr/bin/env bash
# The wheels benchmarks/gpu_report.py uses on a lent GPU machine that lacks them and has no network:
# bitsandbytes (the adamw8bit check) and liger-kernel (the Liger rows), for its Python 3.12, into
# .whl/ (ignored by git; about 42 MB, under the 64 MiB a device call carries). Then, on the device:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   python3 benchmarks/gpu_report.py --output_dir $OUT/report      (carry: .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
exclude="$(git rev-parse --git-common-dir)/info/exclude"  # a worktree's .git is a file: the common one's
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl bitsandbytes==0.50.0 liger-kernel==0.8.5
