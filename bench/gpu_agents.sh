#!/usr/bin/env bash
# Issue 36 (serving agents) on a GPU machine in one call: builds with CUDA,
# compiles the bench model and the tests' CUDA packages in parallel, then,
# the target first: structured output's cost (bench_serve at 16 chats with
# and without a JSON schema held every turn: bench/gpu_front_ends.sh
# STAGE=grammar, PASSES and ROUNDS, within GRAMMAR_S seconds), the bf16
# logprob gap against transformers, the CUDA cases of the agents' tests
# (TESTS, pytest -k cuda: structured output, logprobs, the prefix cache,
# within TEST_S seconds), and with PROFILE=1 the step loop alone
# (bench/profile_grammar.py). Wheels from .deps/wheels
# (bench/fetch_gpu_deps.sh). Results under $OUT; each stage's start time in
# $OUT/stages.txt.
set -uo pipefail
# shellcheck source=bench/gpu_setup.sh
source "$(dirname "$0")/gpu_setup.sh"
status=0
echo "$(date +%T) compile" > "$OUT/stages.txt"
# The bench model and the tests' CUDA packages compile in parallel processes, beside each other.
timeout "${COMPILE_S:-330}" python3 - > "$OUT/bench_model.log" 2>&1 <<'EOF' || status=$?
import sys
from concurrent.futures import ProcessPoolExecutor
sys.path[:0] = ["bench", "tests"]


def build(what: str) -> str:
    import conftest  # noqa: F401  (the tests' cache)
    from bench_serve import bench_package
    from llm_models import llm_package
    from tool_models import tools_package
    return str({"bench": lambda: bench_package("cuda"),
                "qwen3": lambda: llm_package("qwen3", "cuda", max_cache_len=128),
                "qwen3-bf16": lambda: llm_package("qwen3", "cuda", max_cache_len=128, dtype="bfloat16"),
                "tools": lambda: tools_package("cuda")}[what]())


if __name__ == "__main__":
    with ProcessPoolExecutor(4) as pool:
        for path in pool.map(build, ["bench", "qwen3", "qwen3-bf16", "tools"]):
            print(path, flush=True)
EOF
tail -4 "$OUT/bench_model.log"
stage() { echo "$(date +%T) $1" | tee -a "$OUT/stages.txt"; }
stage grammar
STAGE=grammar PASSES=${PASSES:-1} ROUNDS=${ROUNDS:-4} timeout "${GRAMMAR_S:-300}" bash bench/gpu_front_ends.sh 2>&1 \
  | tee "$OUT/grammar.log"
stage logprobs
timeout 120 python3 - <<'EOF' 2>&1 | tee "$OUT/logprobs_bf16.txt"
# The largest gap between the step loop's greedy logprobs (bf16, CUDA graphs) and log_softmax of
# transformers' own bf16 logits for the same tokens, over the sampled token and its top 5.
import sys
sys.path.insert(0, "tests")
import torch
import test_logprobs as t
from aoti_sessions.llm import LLM
from llm_models import llm_package
with LLM(llm_package("qwen3", device="cuda", max_cache_len=t.CONTEXT, dtype="bfloat16"), device="cuda") as m:
    prompt = m.chat_tokens(t.USER)
    with m.new_session() as s:
        out = s.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
    ref = t.transformers_logprobs(prompt + out.token_ids, 16, "cuda", torch.bfloat16)
    gaps = [abs(e.logprob - float(ref[i, e.token])) for i, e in enumerate(out.logprobs)]
    tops = [abs(v - float(ref[i, k])) for i, e in enumerate(out.logprobs) for k, v in e.top]
    print(f"bf16 greedy logprobs, 16 steps: sampled token max gap {max(gaps):.4f}, top-5 max gap {max(tops):.4f}")
EOF
stage tests
TESTS=${TESTS:-tests/test_grammar.py tests/test_logprobs.py tests/test_penalties.py tests/test_prefix_cache.py}
# shellcheck disable=SC2086
timeout "${TEST_S:-300}" python3 -m pytest $TESTS -k cuda -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" \
  || status=$?
if [ -n "${PROFILE:-}" ]; then  # (the step loop alone: a minute more)
  timeout 150 python3 bench/profile_grammar.py --device cuda --rows 16 --rounds 3 2>&1 \
    | grep -v "ais.compile\|Writing\|Loading" | head -12 | tee "$OUT/profile_grammar.txt"
fi
exit $status
