#!/usr/bin/env bash
# Issue 35 item 4 on the GPU: bench_serve with one front end and with N
# (serve --api-workers N), the same model and call. STAGE=ab (default): 64
# chats, api workers 1 then 4 then 2, twice each, no anchor; STAGE=old: an older
# Python package against this tree; STAGE=spy: py-spy over the engine process; STAGE=anchor:
# transformers at B = 16, 64, 256 and the server at 16 and 256 chats with
# 4 front ends; STAGE=targets: issue 35's table in one call (bench_pool, the engine alone, at 1, 16
# and 64 rows; the server at 1, 16, 64 chats against transformers at B = chats); STAGE=targets256: the
# server at 256 chats against transformers at B = 256; STAGE=grammar: 16 chats with and without
# structured output (--response-format json; PASSES, ROUNDS). Results under $OUT.
set -uo pipefail
stage=${STAGE:-ab}
turns=${TURNS:-4}; tokens=${TOKENS:-64}
runs=$OUT/runs; mkdir -p "$runs"
run() {  # NAME CHATS [bench_serve args...]
  local name=$1 chats=$2; shift 2
  python3 bench/bench_serve.py --device cuda --chats "$chats" --turns "$turns" --tokens "$tokens" \
    --modes sessions --out "$runs/$name.md" --server-log "$runs/$name.server.log" "$@" > "$runs/$name.txt" 2>&1
  echo "$name: exit $?"; grep -E "^\| (1|16|64|256) \| sessions" "$runs/$name.md" | head -3
}
trap 'tar czf "$OUT/runs-$stage.tgz" -C "$OUT" runs && rm -rf "$runs"' EXIT
if [ "$stage" = ab ]; then
  for pass in 1 2; do
    for w in 1 4 2; do
      run "w$w-p$pass" 64 --rounds 1 --no-anchor --server-arg=--api-workers=$w
    done
  done
fi
if [ "$stage" = old ]; then
  # An older Python package (OLD_DIR: a folder holding aoti_sessions/, carried along, e.g. made with
  # `git archive COMMIT python/aoti_sessions | tar -x -C build/ab-old --strip-components=1`) against this
  # tree, with this tree's C++ build, 64 chats, 4 front ends, in turn; then the anchor at B = 64.
  old=${OLD_DIR:?OLD_DIR=folder}
  cp "$(python3 -c 'import aoti_sessions._core as c; print(c.__file__)')" "$old/aoti_sessions/"
  for pass in 1 2; do
    run "new-p$pass" 64 --rounds 1 --no-anchor --server-arg=--api-workers=4
    PYTHONPATH=$PWD/$old:$PYTHONPATH run "old-p$pass" 64 --rounds 1 --no-anchor --server-arg=--api-workers=4
  done
  run new-anchor 64 --rounds 1 --anchor --anchor-batches 64 --server-arg=--api-workers=4
fi
if [ "$stage" = spy ]; then
  # Where the engine process's time goes at 64 chats, 4 front ends: py-spy (its wheel in .deps) samples
  # the thread holding the GIL (--gil), per thread, for the run's middle; then the step loop alone.
  spy=$(python3 -c 'import sys, os; print(os.path.join(os.path.dirname(sys.executable), "py-spy"))')
  [ -x /tmp/ais-site/bin/py-spy ] && spy=/tmp/ais-site/bin/py-spy
  ( for i in $(seq 600); do pid=$(pgrep -f llm.process._engine_main | head -1); [ -n "$pid" ] && break; sleep 0.5; done
    sleep "${SPY_AFTER:-20}"
    "$spy" record --pid "$pid" --gil --threads --rate 250 --duration "${SPY_FOR:-40}" --format raw \
      -o "$runs/spy-gil.txt" > "$runs/spy-gil.log" 2>&1 &
    "$spy" record --pid "$pid" --threads --rate 250 --duration "${SPY_FOR:-40}" --format raw \
      -o "$runs/spy-all.txt" > "$runs/spy-all.log" 2>&1
    wait ) &
  turns=4 tokens=160 run spy-64 64 --rounds 6 --no-anchor --server-arg=--api-workers=4
  wait
  python3 bench/profile_llm.py --step-loop 16,64 > "$runs/step-loop.txt" 2>&1; echo "step-loop: exit $?"
fi
if [ "$stage" = anchor ]; then
  run w4-16-64 16,64 --rounds 2 --anchor --anchor-batches 16,64 --server-arg=--api-workers=4
  run w4-256 256 --rounds 1 --no-anchor --server-arg=--api-workers=4 --server-arg=--max-sessions=1024
fi
if [ "$stage" = targets ]; then
  python3 bench/bench_pool.py --device cuda --rows 1,16,64 --rounds 3 --out "$runs/pool.md" > "$runs/pool.txt" 2>&1
  echo "pool: exit $?"; grep -E "^\| (1|16|64) \|" "$runs/pool.md" | head -4
  run w4-1-16-64 1,16,64 --rounds 2 --anchor --anchor-batches 1,16,64 --server-arg=--api-workers=4
fi
if [ "$stage" = targets256 ]; then
  run w4-256 256 --rounds 1 --anchor --anchor-batches 256 --server-arg=--api-workers=4 --server-arg=--max-sessions=1024
fi
if [ "$stage" = grammar ]; then
  # Structured output's cost: 16 chats with every turn held to a JSON schema (masks) against the same bench
  # without, in turn, PASSES times each (default 2), ROUNDS rounds a server (default 1).
  for pass in $(seq "${PASSES:-2}"); do
    run text-p$pass 16 --rounds "${ROUNDS:-1}" --no-anchor --server-arg=--api-workers=4
    run json-p$pass 16 --rounds "${ROUNDS:-1}" --no-anchor --server-arg=--api-workers=4 --response-format json
  done
fi
