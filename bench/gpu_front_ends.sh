#!/usr/bin/env bash
# Issue 35 item 4 on the GPU: bench_serve with one front end and with N
# (serve --api-workers N), the same model and call. STAGE=ab (default): 64
# chats, api workers 1 then 4 then 2, twice each, no anchor; STAGE=anchor:
# transformers at B = 16, 64, 256 and the server at 16 and 256 chats with
# 4 front ends. Results under $OUT.
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
if [ "$stage" = text ]; then
  # The text made in the engine process (OLD, a commit) or in the front ends (this tree), 4 front ends.
  rm -rf build/ab-old && mkdir -p build/ab-old
  git archive "${OLD:?OLD=commit}" python/aoti_sessions | tar -x -C build/ab-old --strip-components=1
  cp "$(python3 -c 'import aoti_sessions._core as c; print(c.__file__)')" build/ab-old/aoti_sessions/
  for pass in 1 2; do
    run "text-front-p$pass" 64 --rounds 1 --no-anchor --server-arg=--api-workers=4
    PYTHONPATH=$PWD/build/ab-old:$PYTHONPATH run "text-engine-p$pass" 64 --rounds 1 --no-anchor \
      --server-arg=--api-workers=4
  done
fi
if [ "$stage" = anchor ]; then
  run w4-16-64 16,64 --rounds 2 --anchor --anchor-batches 16,64 --server-arg=--api-workers=4
  run w4-256 256 --rounds 1 --no-anchor --server-arg=--api-workers=4 --server-arg=--max-sessions=1024
fi
