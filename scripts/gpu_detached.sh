#!/usr/bin/env bash
# A whole GPU run that outlives the device's 10-minute calls: `scripts/gpu_session.sh` with all its
# parts in one background process on the machine, started by one call and collected by the next.
#
# Why: a whole policies run (zoo build, CUDA tests, parts p64, p4, p1, p16) takes about 1,600 s of
# the session's 1,800 s of device time. Split into one call a part (run 25), every call paid its
# own start-up, the warm-up bench ran only to warm caches, and a part cut by its call's limit lost
# everything it had measured. The device keeps a process that started a session of its own (setsid)
# running until the machine goes back (device README), so one background run does all the parts
# back to back, and each part's time limit is capped by the run's deadline (RUN_DEADLINE_S).
#
#   MODE=start  copy the tree to $RUN_DIR/repo, start the run there under setsid, then wait as below
#   MODE=wait   wait until the run is done or WAIT_S seconds (default 560) have passed, then return
#               its latest results.tgz under $OUT and the tail of its log
# Issue each call as the last returns (the machine goes back after 30 s idle), with SPECDEC_COMMIT
# exported on the start call; the run's own $OUT is $RUN_DIR/out, packed every 20 s.
#   RUN_PARTS        the parts, in order (default "zoo tests p64 p4 p1 p16": the shortest last)
#   RUN_DEADLINE_S   seconds from the run's start by which its last part should end (default 1,620:
#                    the machine starts in about 30 s and the budget is 1,800 s)
set -uo pipefail
RETURNED=${OUT:-/tmp/out}; mkdir -p "$RETURNED"
RUN_DIR=/tmp/specdec_detached
MODE=${MODE:-wait}
case $MODE in
  start)
    if [[ -e "$RUN_DIR/started" ]]; then
      echo "a detached run already started on this machine at $(cat "$RUN_DIR/started"); waiting for it"
    else
      # the run works from a copy: the next call re-sends the working tree under the running process
      mkdir -p "$RUN_DIR/out" && cp -r . "$RUN_DIR/repo" && date +%s > "$RUN_DIR/started"
      (cd "$RUN_DIR/repo" && setsid nohup env OUT="$RUN_DIR/out" DONE_FILE="$RUN_DIR/done" WARMUP=0 \
        PARTS="${RUN_PARTS:-zoo tests p64 p4 p1 p16}" RUN_DEADLINE_S="${RUN_DEADLINE_S:-1620}" \
        bash scripts/gpu_session.sh > "$RUN_DIR/run.log" 2>&1 < /dev/null &)
      echo "started the detached run: parts ${RUN_PARTS:-zoo tests p64 p4 p1 p16}, deadline ${RUN_DEADLINE_S:-1620} s"
    fi ;;
  wait) ;;
  *) echo "MODE must be start or wait, got '$MODE'"; exit 2 ;;
esac
[[ -e "$RUN_DIR/started" ]] || { echo "no detached run on this machine (a fresh one?): start one with MODE=start"; exit 3; }
until_s=$(( SECONDS + ${WAIT_S:-560} ))
while (( SECONDS < until_s )) && [[ ! -e "$RUN_DIR/done" ]]; do sleep 5; done
cp "$RUN_DIR/out/results.tgz" "$RETURNED/" 2>/dev/null
cp "$RUN_DIR/run.log" "$RETURNED/detached_run.log" 2>/dev/null
grep -v -i -E "warn|Loading weights" "$RUN_DIR/run.log" | tail -25
since=$(( $(date +%s) - $(cat "$RUN_DIR/started") ))
if [[ -e "$RUN_DIR/done" ]]; then echo "the detached run is done, $since s after its start"
else echo "the detached run is still going, $since s after its start: call again with MODE=wait"; fi
