#!/usr/bin/env bash
# A whole GPU run that outlives the device's 10-minute calls: `scripts/gpu_session.sh` with all its
# parts in one background process on the machine, started by one call and collected by the next.
#
# Why: a whole policies run (zoo build, CUDA tests, parts p64, p4, p1, p16) takes about 1,600 s of
# the session's 1,800 s of device time. Split into one call a part (run 25), every call paid its
# own start-up, the warm-up bench ran only to warm caches, and a part cut by its call's limit lost
# everything it had measured. The device keeps a process that started a session of its own (setsid)
# running until the machine goes back (device README), so one background run does all the parts
# back to back, and each part's time limit is capped by the run's deadline.
#
#   MODE=start  copy the tree to $RUN_DIR/repo, start the run there under setsid, then wait as below
#   MODE=wait   wait until the run is done or has died, or WAIT_S seconds (default 570) have passed,
#               copying its latest results.tgz and log under $OUT every 15 s (a call cut off by the
#               session's device time still returns the last copy)
# Exit status: 0 the run is done, 10 still going (call MODE=wait again at once: the machine goes
# back after 30 s idle, and the run with it), 11 the run died without finishing, 3 no run here.
# If the run dies at the first call's end (not yet tried on the device), fall back to one call a part
# on the same warm machine (`PARTS=p64 bash scripts/gpu_session.sh`, and so on, as in run 25): the zoo
# the run built stays in /tmp/zoo, and the parts it finished are in the last results.tgz returned.
#   RUN_PARTS        the parts, in order (default "zoo tests p64 p4 p1 p16": the shortest last)
#   RUN_DEADLINE_S   seconds from now by which the last part should end (start: default 1,680, the
#                    budget's 1,800 less a minute's start and a margin; the machine also goes back 30
#                    minutes after it started). Give it again on every wait call as the reply's
#                    lease.budget_left_s less 40: it moves the deadline earlier, never later, and the
#                    parts still to start are capped by it. Run 25's parts took about 225 s (zoo build,
#                    tests beside it), 300 (p64), 370 (p4), 420 (p1), 265 (p16): 1,580 s back to back
set -uo pipefail
RETURNED=${OUT:-/tmp/out}; mkdir -p "$RETURNED"
RUN_DIR=/tmp/specdec_detached
MODE=${MODE:-wait}
now() { date +%s; }
case $MODE in
  start)
    if [[ -e "$RUN_DIR/started" ]]; then
      echo "a detached run already started on this machine at $(cat "$RUN_DIR/started"); waiting for it"
    else
      # the run works from a copy: the next call re-sends the working tree under the running process
      rm -rf "$RUN_DIR" && mkdir -p "$RUN_DIR/out" && cp -r . "$RUN_DIR/repo" \
        || { echo "could not copy the tree to $RUN_DIR/repo: no run started"; exit 4; }
      echo $(( $(now) + ${RUN_DEADLINE_S:-1680} )) > "$RUN_DIR/deadline_epoch"
      # exec: the subshell becomes setsid (its own session, so the run outlives this call), and the
      # redirections leave nothing holding this call's output open; descriptors above 2 are closed
      (
        cd "$RUN_DIR/repo" || exit 1
        for fd in /proc/$BASHPID/fd/*; do fd=${fd##*/}; (( fd > 2 )) && eval "exec $fd>&-"; done 2>/dev/null
        echo $BASHPID > "$RUN_DIR/pid"
        exec setsid nohup env OUT="$RUN_DIR/out" DONE_FILE="$RUN_DIR/done" WARMUP=0 \
          PARTS="${RUN_PARTS:-zoo tests p64 p4 p1 p16}" RUN_DEADLINE_FILE="$RUN_DIR/deadline_epoch" \
          bash scripts/gpu_session.sh
      ) > "$RUN_DIR/run.log" 2>&1 < /dev/null &
      now > "$RUN_DIR/started"
      echo "started the detached run: parts ${RUN_PARTS:-zoo tests p64 p4 p1 p16}, deadline in ${RUN_DEADLINE_S:-1680} s"
    fi ;;
  wait)
    if [[ -n "${RUN_DEADLINE_S:-}" && -e "$RUN_DIR/deadline_epoch" ]]; then
      proposed=$(( $(now) + RUN_DEADLINE_S ))
      if (( proposed < $(cat "$RUN_DIR/deadline_epoch") )); then
        echo "$proposed" > "$RUN_DIR/deadline_epoch"; echo "deadline moved to $RUN_DEADLINE_S s from now"
      fi
    fi ;;
  *) echo "MODE must be start or wait, got '$MODE'"; exit 2 ;;
esac
[[ -e "$RUN_DIR/started" ]] || { echo "no detached run on this machine (a fresh one?): start one with MODE=start"; exit 3; }
# copies renamed into place, so a call killed mid-copy still leaves the previous whole file
collect() {
  [[ -e "$RUN_DIR/out/results.tgz" ]] && cp "$RUN_DIR/out/results.tgz" "$RETURNED/.results.copy" \
    && mv -f "$RETURNED/.results.copy" "$RETURNED/results.tgz"
  cp "$RUN_DIR/run.log" "$RETURNED/.log.copy" 2>/dev/null && mv -f "$RETURNED/.log.copy" "$RETURNED/detached_run.log"
}
alive() { [[ -e "$RUN_DIR/pid" ]] && kill -0 "$(cat "$RUN_DIR/pid")" 2>/dev/null; }
sleep 2  # a run just started has written its pid by now
until_s=$(( SECONDS + ${WAIT_S:-570} ))
while (( SECONDS < until_s )) && [[ ! -e "$RUN_DIR/done" ]] && alive; do
  collect; for _ in 1 2 3; do [[ -e "$RUN_DIR/done" ]] && break; sleep 5; done
done
collect
grep -v -i -E "warn|Loading weights" "$RUN_DIR/run.log" | tail -25
since=$(( $(now) - $(cat "$RUN_DIR/started") ))
if [[ -e "$RUN_DIR/done" ]]; then echo "the detached run is done, $since s after its start"; exit 0; fi
if ! alive; then echo "the detached run died without finishing, $since s after its start (its log is above)"; exit 11; fi
echo "the detached run is still going, $since s after its start, $(( $(cat "$RUN_DIR/deadline_epoch") - $(now) )) s before its deadline: call MODE=wait again now"
exit 10
