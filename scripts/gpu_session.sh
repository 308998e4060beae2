#!/usr/bin/env bash
# One call on the GPU machine (it has no network and a bare disk): versions, the gpu zoo build,
# then the parts named in $PARTS (space-separated), everything written under $OUT.
#   tests     python -m pytest -m cuda (about 2 min)
#   bench     python -m specdec bench (zoo against Hugging Face + bandwidth floor, about 7 min)
#   quick     python -m specdec bench --quick (about 4 min)
#   policies  python -m specdec bench --policies, median of 3 interleaved passes per method;
#             $POLICY_ARGS (default --num-prompts 32 --time-limit-s 330) picks requests, batch
#             sizes, time limit and --name; runs at different batch sizes merge with
#             `bench --policies --merge A.json B.json`. On a fresh machine the zoo build takes
#             3-3.5 minutes and the policy bench's own set-up 1.5-2 more: batch 4 (3 workloads,
#             16 requests) needs a call of its own on a warm machine, as does batch 1
#   zoo       only the gpu zoo build (and a short compile of its models), for later calls on the
#             same machine (it stays warm for about 30 s after a call)
#   p64, p16, p4, p1   the parts of one policies run, one call each right after the zoo call
#             (set SPECDEC_ZOO_DIR as the zoo call did; the machine goes back 30 minutes after it
#             started): 3 grid passes per method (of 2 calls at batch 16 and 64), then 8 head-to-head
#             rounds per cell (6 at batch 1; a batch-1 profile of 8 requests x 2 rounds; at batch 16
#             and 4 BatchAdaptivePolicy's profile draws 48 requests once). Run 19's machine took 434 s
#             for the zoo call, 519 s for batch 64 and 359 s for batch 16; run 20's 331 s (zoo), 365 s
#             (b64), 283 s (b16), 439 s (b4, three workloads). The machine goes back 30 minutes after
#             it started, but only at the end of the call in flight (device README, Limits): so a
#             whole run is `PARTS="zoo tests"` (tests beside the build), then p1 (three workloads,
#             about 450 s: run 20's b1 `mixed` took 189 s, 120 s of it timed), p64, p16 and p4 last,
#             started before the 30 minutes are up. Run 21 (an H100): 425 s (zoo with tests), 526 s
#             (b1), 415 s (b64), 342 s (b16), 397 s (b4, whose then 330 s limit left out
#             `continuation`, measured later as part p4c); the last call ended 36 minutes after the
#             machine started. Run 22 (an H200, whose held time all counted as device time): 320 s
#             (zoo with tests), 456 s (b1), 384 s (b64), 574 s (b16, then a b4 `mixed` part that its
#             110 s limit left empty); 1788 s of the 1800 were spent, so p4 needs a session of its own
#             or a shorter grid. Run 20 ran b1 as part `p1m`
#             (`--workloads mixed --time-limit-s 140`) in the 5 minutes it thought were left.
#             Merge with `python -m specdec bench --policies --merge` (a part cut by its time limit
#             lists its skipped cells). Run 24 (H200, after the compiled-graphs fix, whose runner builds
#             took 21-26 s a part against run 23's 52-127 s): 337 s (zoo, tests and a tieprobe), 425 s
#             (p1), 367 s (p4), 232 s (p16); all held time counted. A whole run on one machine is
#             then about 300 + 425 + 370 + 235 + ~330 (p64) s plus the start: order it zoo+tests, p64,
#             p4, p1, then p16 last (the shortest) with PART_LIMIT_S set below the time left. Run 25
#             (H200, ff167ab) so: 308 s (zoo with tests; 337 s held with the start), 296 s (p64), 368 s
#             (p4), then p1 (P1_LIMIT_S=370) ran past its call's 440 s and returned nothing, and p16
#             (limit 190) took 264 s. A whole run is now one detached process instead:
#             scripts/gpu_detached.sh (the parts back to back, each capped by the run's deadline)
#   tieprobe  scripts/bf16_shape_probe.py --compile --bucket-logits --log-recompiles for each capture
#             order in $PROBE_ORDERS (default: library odd-first ascending); needs no zoo
#   demo      python -m specdec demo --preset gpu --device cuda
#   noise     scripts/noise_probe.py: identical passes timed default, pinned, one thread, GPU warmed
#             (about 1.5 minutes after the zoo build)
# A call may run at most 10 minutes: the zoo build takes about 3, so pick one long part per call.
# Set SPECDEC_COMMIT to the commit being measured (the tree travels without .git). PIN (optional,
# e.g. PIN=2-5) runs the benches under `taskset -c $PIN`: the policy runs of session 4 ran at two
# speeds from pass to pass, and pinning the process to cores near the GPU is the first thing to
# try against that (versions.txt records the GPU's CPU affinity and the host's CPUs).
# What comes back: the device returns at most 8 files from $OUT (run 22 lost a part's JSON past that
# limit), so every file is written to a work folder and packed into $OUT/results.tgz after each
# step; a call killed by its time limit still returns what its finished steps wrote. Unpack here
# with `tar xzf results.tgz -C somewhere`; a background packer also packs every PACK_EVERY_S (20) s.
# PART_LIMIT_S (default 420; P1_LIMIT_S for p1) is the p64/p16/p4/p1 parts' own time limit, after
# which no cell starts: a part lasts up to its limit plus the cell it is in (about 110 s at batch 1)
# and its write-up, so keep limit + 140 s below the call's remaining device time.
# WARMUP=0 leaves out the zoo part's short warm-up bench; RUN_DEADLINE_FILE, RUN_DEADLINE_S, DONE_FILE:
# see run_part and gpu_detached.sh.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true SPECDEC_ZOO_DIR=${SPECDEC_ZOO_DIR:-/tmp/zoo}
RETURNED=${OUT:-/tmp/out}; mkdir -p "$RETURNED"
# the work folder is named by the folder returned, so a detached run (gpu_detached.sh) and a plain call never share one
OUT=/tmp/specdec_gpu_session_out_$(printf %s "$RETURNED" | md5sum | cut -c1-8); rm -rf "$OUT"; mkdir -p "$OUT"
# (tar exits 1 when a file changed as it read it, e.g. the CUDA tests' log written beside the build: still a pack;
# each pack writes a name of its own and renames it, so the background packer and a step's pack never clash)
pack() {
  local part="$RETURNED/.results.$BASHPID.part"
  tar czf "$part" -C "$OUT" . ; if [[ $? -le 1 ]]; then mv -f "$part" "$RETURNED/results.tgz"; else rm -f "$part"; fi
}
# a background packer every PACK_EVERY_S seconds: run 25's b1 part ran past its call's limit, which
# killed the EXIT trap's pack too, and its two finished cells (the bench rewrites a .partial.json
# after every cell) were lost with it
( while sleep "${PACK_EVERY_S:-20}"; do pack; done ) >/dev/null 2>&1 &
PACKER_PID=$!
# DONE_FILE (set by scripts/gpu_detached.sh): touched once everything is packed
trap 'kill $PACKER_PID 2>/dev/null; wait $PACKER_PID 2>/dev/null; pack; rm -f "$RETURNED"/.results.*.part; [[ -n "${DONE_FILE:-}" ]] && touch "$DONE_FILE"' EXIT
PART_LIMIT_S=${PART_LIMIT_S:-420}
PARTS=${PARTS:-tests}
quiet() { grep -v -i -E "warn|Loading weights|dynamo|generation_config" ; }
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$OUT/versions.txt"
{ nvidia-smi topo -m; lscpu | grep -E "^(Model name|CPU\(s\)|NUMA|Thread|Core|Socket)"; } >> "$OUT/versions.txt" 2>&1
RUN=python3; [[ -n "${PIN:-}" ]] && RUN="taskset -c $PIN python3"
# the card names the parts' files (a call for an H200 may get an H100: run 21)
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E "h100|h200|a100|l40s" | head -1 | tr 'A-Z' 'a-z')
GPU_TAG=${GPU_TAG:-gpu}
# with `zoo`, the CUDA tests run beside the zoo build (they build tiny models of their own and time
# nothing; the build's training only takes a little longer), so the zoo call holds both
TESTS_PID=
if [[ " $PARTS " =~ " tests " ]]; then
  if [[ " $PARTS " =~ " zoo " ]]; then
    timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider > "$OUT/cuda_tests.log" 2>&1 &
    TESTS_PID=$!
  else
    timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider > "$OUT/cuda_tests.log" 2>&1; tail -25 "$OUT/cuda_tests.log"; pack
  fi
fi
if [[ " $PARTS " =~ " bench " || " $PARTS " =~ " quick " || " $PARTS " =~ " policies " || " $PARTS " =~ " demo " || " $PARTS " =~ " zoo " || " $PARTS " =~ " noise " || " $PARTS " =~ " p" ]]; then
  # (a zoo already built on this machine is reused: a policies part on a fresh machine builds its own)
  timeout "${BUILD_TIMEOUT:-300}" python3 -m specdec zoo build --preset gpu --device cuda 2>&1 | tr '\r' '\n' \
    | grep -v -E "Writing model|Loading weights|it/s" | tail -6 | tee "$OUT/zoo_build.log"
  cp "$SPECDEC_ZOO_DIR/gpu/manifest.json" "$OUT/zoo_gpu_manifest.json" 2>/dev/null
  pack
fi
[[ " $PARTS " =~ " bench " ]] && $RUN -m specdec bench --out "$OUT" 2>&1 | quiet | tee "$OUT/bench.log" | tail -40; pack
[[ " $PARTS " =~ " quick " ]] && $RUN -m specdec bench --quick --out "$OUT" 2>&1 | quiet | tee "$OUT/bench_quick.log" | tail -30; pack
[[ " $PARTS " =~ " zoo " && ${WARMUP:-1} == 1 ]] && python3 -m specdec bench --policies --preset gpu --device cuda --quick \
  --workloads mixed --time-limit-s 30 --out /tmp/warm 2>&1 | quiet | tail -3
[[ -n "$TESTS_PID" ]] && { wait "$TESTS_PID"; tail -25 "$OUT/cuda_tests.log"; pack; }
[[ " $PARTS " =~ " noise " ]] && PYTHONPATH=. python3 scripts/noise_probe.py --out "$OUT" 2>&1 | quiet | tee "$OUT/noise.log" | tail -12; pack
[[ " $PARTS " =~ " policies " ]] && $RUN -m specdec bench --policies --preset gpu --device cuda \
  ${POLICY_ARGS:---num-prompts 32 --time-limit-s 330} --out "$OUT" 2>&1 | quiet | tee "$OUT/policies.log" | tail -30; pack
# one part of a policies run: policies_part NAME ARGS... (full log under $OUT, progress lines shown).
# The length policies draft with $POLICY_DRAFTER (default drafter-4L-narrow, as in run 26 and most before): left to the
# bench, they take the model drafter of least held-out loss, and the zoo's GPU training is not
# bit-reproducible, so run 27's build picked drafter-2L (loss 2.655 against 4L-narrow's 2.679; run 26:
# 2.841 and 2.648) and its runs did not compare with run 26's. POLICY_DRAFTER="" leaves it to the bench
# (such parts do not merge with named ones: the merge compares policy_drafter)
policies_part() {
  local name=$1; shift
  local drafter=${POLICY_DRAFTER-drafter-4L-narrow}
  $RUN -m specdec bench --policies --preset gpu --device cuda --num-prompts 16 --history-prompts 8 --pass-calls 2 \
    ${drafter:+--policy-drafter "$drafter"} \
    --out "$OUT" --name "policies_${GPU_TAG}_$name" "$@" 2>&1 | tee "$OUT/policies_$name.log" \
    | grep -E "elapsed|wrote|skipped|warning:|Error|head to head" | tail -12
  pack
}
[[ -z "${SPECDEC_COMMIT:-}" && " $PARTS " =~ " p" ]] && echo "warning: SPECDEC_COMMIT is not set; the results will record the GPU copy's stale commit"
# one part by name (p64, p16, p4, p4c, p1, p1m), run in the order $PARTS names them. Under a detached
# whole run (scripts/gpu_detached.sh) the deadline (RUN_DEADLINE_FILE: its epoch seconds, which a later
# call may move earlier; or RUN_DEADLINE_S, seconds from this script's start) caps each part's time
# limit at the seconds left less the part's tail: after its limit a part still finishes the cell it
# is in and writes its report (about 140 s at batch 1, whose cells take about 110 s; 80 s at batch 4-64;
# PART_TAIL_S overrides both). Run 25's p1 with P1_LIMIT_S=370 ran past a 440 s call. A part whose
# capped limit falls below MIN_PART_LIMIT_S (its set-up alone takes 60-110 s) is skipped
seconds_left() {
  if [[ -n "${RUN_DEADLINE_FILE:-}" && -e "${RUN_DEADLINE_FILE:-}" ]]; then echo $(( $(cat "$RUN_DEADLINE_FILE") - $(date +%s) ))
  elif [[ -n "${RUN_DEADLINE_S:-}" ]]; then echo $(( RUN_DEADLINE_S - SECONDS ))
  fi
}
run_part() {
  local part=$1 name limit=$PART_LIMIT_S tail=80 left args
  case $part in
    p64) name=b64; args=(--batch-sizes 64 --head-to-head-rounds 8) ;;
    p16) name=b16; args=(--batch-sizes 16 --head-to-head-rounds 8 --profile-prompts 48 --profile-repeats 1) ;;
    p4) name=b4; args=(--batch-sizes 4 --head-to-head-rounds 8 --profile-prompts 48 --profile-repeats 1) ;;
    # one workload at batch 4 (run 21's p4 reached its 330 s limit before `continuation`): 248 s after a
    # `zoo` call on the same machine. On a fresh machine without that call's warm-up, the zoo build and
    # this part did not fit one call: the part's compilation ran cold, and no cell was done at 600 s
    p4c) name=b4_continuation; limit=100000
      args=(--batch-sizes 4 --head-to-head-rounds 8 --profile-prompts 48 --profile-repeats 1 --workloads continuation) ;;
    p1) name=b1; limit=${P1_LIMIT_S:-400}; tail=140; args=(--batch-sizes 1 --head-to-head-rounds 6 --profile-prompts 8 --profile-repeats 2) ;;
    p1m) name=b1; limit=140; tail=140
      args=(--batch-sizes 1 --head-to-head-rounds 6 --profile-prompts 8 --profile-repeats 2 --workloads mixed) ;;
  esac
  tail=${PART_TAIL_S:-$tail}
  left=$(seconds_left)
  if [[ -n "$left" ]]; then
    (( left - tail < limit )) && limit=$(( left - tail ))
    if (( limit < ${MIN_PART_LIMIT_S:-150} )); then echo "part $part skipped: $left s left before the run's deadline"; return; fi
  fi
  echo "part $part, time limit $limit s, at $SECONDS s${left:+, $left s before the deadline}"
  policies_part "$name" "${args[@]}" --repeats 3 --time-limit-s "$limit"
}
for part in $PARTS; do
  case $part in
    p64|p16|p4|p4c|p1|p1m) run_part "$part" ;;
    p*) echo "warning: no part named '$part' (the policies parts are p64 p16 p4 p4c p1 p1m)" ;;
  esac
done
# the bf16 near-tie probe (BENCHMARKS run 23): a random gpu-shaped target, no zoo; about 2 minutes a capture order
if [[ " $PARTS " =~ " tieprobe " ]]; then
  for order in ${PROBE_ORDERS:-library odd-first ascending}; do
    timeout 200 env PYTHONPATH=. python3 scripts/bf16_shape_probe.py --compile --lengths 6,7,8 --batch-sizes 64,32 \
      --bucket-logits --log-recompiles --capture-order "$order" --out "$OUT/bf16_probe_$order.json" 2>&1 \
      | grep -v -i warn | tee "$OUT/bf16_probe_$order.log" | grep -E "^b[0-9]|bucket logits|Recompiling|triggered|wrote"
    pack
  done
fi
[[ " $PARTS " =~ " demo " ]] && $RUN -m specdec demo --preset gpu --device cuda --json "$OUT/demo_gpu.json" 2>&1 | quiet | tee "$OUT/demo_gpu.log"; pack
exit 0
