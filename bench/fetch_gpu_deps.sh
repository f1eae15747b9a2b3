#!/usr/bin/env bash
# Run on a machine with a package index, before bench/gpu_check.sh on a GPU
# machine without one: downloads into .deps/ (git-ignored, carried along) the
# Python 3.12 wheels the build and tests need, and GoogleTest as a Debian
# package (headers + static libraries, unpacked).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/wheels .deps/gtest
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .deps/wheels \
  pytest pluggy iniconfig packaging pathspec pybind11==3.1.0 scikit-build-core==1.1.2 \
  pybind11-stubgen==3.0.0 mypy==2.4.1 mypy_extensions librt ast-serialize
# aoti_sessions.llm and the server (tests, bench_serve), with their dependencies;
# numpy is on the GPU machine already, and the hub's optional extras are not needed.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .deps/wheels \
  transformers==5.24.0 fastapi uvicorn uvloop httptools httpx openai
rm -f .deps/wheels/numpy-* .deps/wheels/hf_xet-* .deps/wheels/pygments-* .deps/wheels/rich-* \
  .deps/wheels/markdown_it_py-* .deps/wheels/mdurl-*
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download libgtest-dev)
dpkg -x "$tmp"/libgtest-dev*.deb .deps/gtest
rm -rf "$tmp"
grep -qx '/.deps/' .git/info/exclude 2>/dev/null || echo '/.deps/' >> .git/info/exclude
du -sh .deps
