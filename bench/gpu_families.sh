#!/usr/bin/env bash
# Issue 37's GPU part in one call: the families added in stop 47 (FAMILIES) on CUDA. Builds with CUDA
# (bench/gpu_setup.sh), compiles each family's float32 and bfloat16 CUDA packages in parallel (JOBS
# processes, within COMPILE_S seconds), then runs test_llm_export's CUDA cases for them (float32 greedy
# equality, decode captured as CUDA graphs) and the bf16 two-turn chats (test_bfloat16_two_turn_chat_on_cuda),
# within TEST_S seconds. A part of it: PACKAGES="family:dtype ..." and TEST_K (pytest's -k). Results under
# $OUT: results.txt (each package's outcome, each test's), compile.log, pytest.log, guards.log.
set -uo pipefail
# shellcheck source=bench/gpu_setup.sh
source "$(dirname "$0")/gpu_setup.sh"
FAMILIES=${FAMILIES:-deepseek_v2 deepseek_v3 llama4 ernie4_5_moe jamba falcon_h1 zamba2 minimax}
status=0
echo "$(date +%T) compile" > "$OUT/stages.txt"
# shellcheck disable=SC2086
timeout "${COMPILE_S:-300}" python3 - $FAMILIES > "$OUT/compile.log" 2>&1 <<'PY' || status=$?
# Each package's outcome on a line of its own ("family dtype: path" or "... FAILED: why"); the guards each
# export added (symbolic shapes' "[guard added]" lines, which say where a row count got bounded) in guards.log.
import logging, os, sys, traceback
from concurrent.futures import ProcessPoolExecutor
sys.path[:0] = ["tests"]


def build(job: tuple[str, str]) -> str:
    import conftest  # noqa: F401  (the tests' cache)
    from llm_models import llm_package
    family, dtype = job
    guards = logging.FileHandler(os.path.join(os.environ["OUT"], "guards.log"))
    guards.setFormatter(logging.Formatter(f"{family} {dtype}: %(message)s"))
    guards.addFilter(lambda record: "guard added" in record.getMessage())
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    shapes.setLevel(logging.INFO)
    shapes.addHandler(guards)
    try:
        return f"{family} {dtype}: {llm_package(family, 'cuda', dtype=dtype)}"
    except Exception as e:  # noqa: BLE001 - reported, the others go on
        traceback.print_exc()
        return f"{family} {dtype}: FAILED: {str(e).splitlines()[0][:600]}"
    finally:
        shapes.removeHandler(guards)


if __name__ == "__main__":
    chosen = os.environ.get("PACKAGES", "").split()  # "family:dtype" ..., where not every family's two
    jobs = [tuple(p.split(":")) for p in chosen] or [(f, d) for f in sys.argv[1:] for d in ("float32", "bfloat16")]
    with ProcessPoolExecutor(int(os.environ.get("JOBS", "16"))) as pool:
        for line in pool.map(build, jobs):
            print("RESULT", line, flush=True)
PY
grep '^RESULT' "$OUT/compile.log" | tee "$OUT/results.txt"
echo "$(date +%T) tests" >> "$OUT/stages.txt"
selected=$(echo "$FAMILIES" | sed 's/ / or /g')
timeout "${TEST_S:-240}" python3 -m pytest tests/test_llm_export.py -k "${TEST_K:-cuda and ($selected)}" -v --tb=line -rs \
  -p no:cacheprovider > "$OUT/pytest.log" 2>&1 || status=$?
grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|^/|^E " "$OUT/pytest.log" | cut -c1-400 >> "$OUT/results.txt"
exit $status
