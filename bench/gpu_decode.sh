#!/usr/bin/env bash
# Issue 38's GPU part in one call: fused projections and quantized weights. Builds with CUDA
# (bench/gpu_setup.sh), compiles bench_decode's packages (SHAPES x VARIANTS, bf16) and the tests' quantized
# CUDA packages (TEST_JOBS) in parallel (JOBS processes, within COMPILE_S seconds), runs the CUDA cases of TEST_FILES
# (tests/test_quantize.py, test_fused.py, test_decode_one.py, test_one_row.py, test_kv_write.py, test_gemv_int4.py, test_int8_mm.py) and, where TEST_K is given, of test_llm_export (pytest's
# -k), within TEST_S seconds (TESTS=0: neither the tests nor their packages); then bench/bench_decode.py (ROUNDS, ANCHOR=1 for transformers compiled at
# B = 1; KERNELS=N lists each variant's N costliest kernels a step) within BENCH_S seconds, on the packages the compile stage built (a variant it did not finish is named, not
# compiled then; BENCH_S=0: no bench). Results under $OUT: results.txt, compile.log, pytest.log, decode.md.
# A machine kept warm between calls is not to be counted on (it went back between two calls in stop 55), and a
# package compiles 2-3x slower on some machines than on others. Issue 38's four packages (a decode_one package is
# benched both ways, bench_decode's doc) compiled together in 352 s with 4 jobs on a fresh machine in stop 57,
# leaving the bench (2 rounds, the kernels, the accuracy rows) the rest of one call:
#   PAIRS="0.6b:one 4b-slice:one 4b-slice:int8wo-one 4b-slice:int4wo-one" TESTS=0 SHAPES=0.6b,4b-slice \
#     VARIANTS=one,int8wo-one,int4wo-one COMPILE_S=450 DEADLINE_S=500 ROUNDS=2 KERNELS=12 JOBS=4 \
#     EARLY="tests/test_gemv_int4.py tests/test_int8_mm.py tests/test_one_row.py -k cuda" bash bench/gpu_decode.sh
#   (where the compile does not finish: the same at once on the warm machine with COMPILE_S=60, no EARLY)
set -uo pipefail
# shellcheck source=bench/gpu_setup.sh
source "$(dirname "$0")/gpu_setup.sh"
SHAPES=${SHAPES:-0.6b,4b-slice}
VARIANTS=${VARIANTS:-fused,unfused,int8wo,int4wo}
# PAIRS (e.g. "0.6b:fused 4b-slice:int8wo"): compile these shape:variant pairs alone, not SHAPES x VARIANTS
# ("none": no bench package, the tests' alone).
export PAIRS=${PAIRS:-}
status=0
# DEADLINE_S: the bench stage ends that many seconds after this line at the latest, whatever the stages
# before it took (a compile stage done early leaves the bench the rest); BENCH_S where not given.
start=$SECONDS
# EARLY: a pytest selection run beside the compile stage, on the GPU the compilers leave idle (e.g. a kernel's
# CUDA cases, which need no package): $OUT/early.log.
[ -z "${EARLY:-}" ] || { timeout "${COMPILE_S:-300}" python3 -m pytest $EARLY -v --tb=short -rs -p no:cacheprovider \
  > "$OUT/early.log" 2>&1 & }
echo "$(date +%T) compile" > "$OUT/stages.txt"
timeout "${COMPILE_S:-300}" python3 - "$SHAPES" "$VARIANTS" > "$OUT/compile.log" 2>&1 <<'PY' || status=$?
import os, sys, traceback
from concurrent.futures import ProcessPoolExecutor
sys.path[:0] = ["bench", "tests"]


def build(job: tuple[str, str]) -> str:
    import conftest  # noqa: F401  (the tests' cache)
    kind, what = job
    try:
        if kind == "bench":
            from bench_decode import SHAPES, VARIANTS
            from bench_serve import bench_package
            shape, variant = what.split(":")
            return f"{what}: {bench_package('cuda', dtype='bfloat16', **VARIANTS[variant], **SHAPES[shape])}"
        if what == "decode_one":  # test_decode_one's
            from llm_models import llm_package
            return f"{what}: {llm_package('qwen3', 'cuda', dtype='bfloat16', decode_one=True)}"
        from test_quantize import _package
        scheme, _, one = what.partition("-")
        return f"{what}: {_package('cuda', 'bfloat16', scheme, one == 'one')}"
    except Exception as e:  # noqa: BLE001 - reported, the others go on
        traceback.print_exc()
        return f"{what}: FAILED: {str(e).splitlines()[0][:600]}"


if __name__ == "__main__":
    shapes, variants = sys.argv[1].split(","), sys.argv[2].split(",")
    tests = [("test", q) for q in os.environ.get("TEST_JOBS", "int8wo int4wo int8wo-one int4wo-one decode_one").split()] \
        if os.environ.get("TESTS", "1") != "0" else []
    pairs = [] if os.environ.get("PAIRS") == "none" else \
        os.environ.get("PAIRS", "").split() or [f"{s}:{v}" for s in shapes for v in variants]
    jobs = [("bench", p) for p in pairs] + tests
    with ProcessPoolExecutor(int(os.environ.get("JOBS", "12"))) as pool:
        for line in pool.map(build, jobs):
            print("RESULT", line, flush=True)
PY
grep '^RESULT' "$OUT/compile.log" | tee "$OUT/results.txt"
# WRAPPERS=1: each built package's decode_one host code (AOTInductor's wrapper .cpp: the kernels a step, in
# order, with what feeds each) as $OUT/wrapper-<shape>-<variant>.cpp.txt, to see which kernels a layer runs and why
# (plain files of plain names: a tar of them did not come back in stop 57).
if [ -n "${WRAPPERS:-}" ]; then
  grep '^RESULT' "$OUT/compile.log" | grep -v FAILED | while read -r _ what path; do
    python3 - "$path" "$OUT/wrapper-$(echo "${what%:}" | tr -c 'A-Za-z0-9.\n' '-').cpp.txt" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if "/decode_one/" in name and name.endswith(".wrapper.cpp"):
            open(sys.argv[2], "wb").write(z.read(name))
PY
  done
fi
echo "$(date +%T) tests" >> "$OUT/stages.txt"
[ "${TESTS:-1}" = 0 ] || timeout "${TEST_S:-150}" python3 -m pytest \
  ${TEST_FILES:-tests/test_quantize.py tests/test_fused.py tests/test_decode_one.py tests/test_one_row.py tests/test_kv_write.py tests/test_gemv_int4.py tests/test_int8_mm.py} \
  ${TEST_K:+tests/test_llm_export.py} -k "${TEST_K:+($TEST_K) or }cuda or fused or in_place" -v --tb=line -rs \
  -p no:cacheprovider > "$OUT/pytest.log" 2>&1 || status=$?
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^/|^E " "$OUT/pytest.log" | cut -c1-400 >> "$OUT/results.txt"
wait
[ -z "${EARLY:-}" ] || grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/early.log" | cut -c1-400 >> "$OUT/results.txt"
echo "$(date +%T) bench" >> "$OUT/stages.txt"
BENCH_S=${BENCH_S:-$(( ${DEADLINE_S:-100000} - (SECONDS - start) ))}
[ "$BENCH_S" -gt 0 ] || BENCH_S=0
[ "${BENCH_S:-240}" = 0 ] || timeout "${BENCH_S:-240}" python3 bench/bench_decode.py --shapes "$SHAPES" --variants "$VARIANTS" \
  --rounds "${ROUNDS:-3}" ${ANCHOR:+--anchor} ${KERNELS:+--kernels "$KERNELS"} --only-built 2>&1 | tee "$OUT/decode.md" \
  | grep -E '^[|#-]' || status=$?
exit $status
