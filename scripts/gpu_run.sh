#!/usr/bin/env bash
# The standard GPU run, as one command on the device machine (no network, a bare disk; it runs
# over a copy of the working tree without .git, so set SPECDEC_COMMIT to the commit measured):
#
#   SPECDEC_COMMIT=$(git rev-parse --short HEAD) PARTS="tests quick" bash scripts/gpu_run.sh
#
# PARTS (space-separated, run in this order):
#   tests     python -m pytest -m cuda, over $TEST_WORKERS (default 4) pytest-xdist workers sharing the GPU where
#             xdist is installed (serially the suite outgrew a call: over 400 s); two-GPU tests run where two are seen
#   quick     python -m specdec bench --quick (the zoo against Hugging Face and the bandwidth floor, ~4 min)
#   bench     python -m specdec bench (the same, every batch size, ~7 min)
#   bandwidth python -m specdec bench --quick --parts bandwidth (the 8B shape's plain step against its floor and HF's
#             static cache, batch 1 and 16, with the ablation rows of issue 36's changes; no zoo; ~5 min)
#   host      experiments/host_critical_path.py --compile (the 8B step's host critical path at batch 1, run-ahead off; ~1 min)
#   hostprof  experiments/host_step_profile.py --compile on the gpu zoo's target shape (random weights), plain decoding
#             and k = 4 with a graphed drafter of the zoo's 4-layer shape: where a speculative step's host time goes
#   trees     python -m specdec bench --parts trees (chains against token trees, batch $BATCH_SIZES, default 1,4,16,64,
#             temperatures $TEMPERATURES, default 0,0.8; more options in $TREES_ARGS, e.g. "--dtype float32")
#   verifiers python -m specdec bench --parts verifiers (padded, padding-free and decomposed verification of ragged
#             draft lengths, batch $BATCH_SIZES, default 1,16,64)
#   pipeline  python -m specdec bench --parts pipeline (random-weight 1B and 8B targets, drafting beside verification
#             on a side stream and, with two GPUs, on the second; batch $BATCH_SIZES, default 16,64; no zoo)
#   tp        torchrun over $TP_NPROC GPUs (default 2): benchmarks/tensor_parallel_bench.py (random-weight 8B and 30B
#             targets sharded tensor-parallel, the 8B also on one GPU; ~2.5 min on two H200s; options in $TP_ARGS;
#             it writes tensor_parallel.json: rename it tensor_parallel_<machine>_<commit>.json in benchmarks/results)
#   long      python -m specdec bench --long-context on the gpu-long zoo (built first, with its SPIRe drafts:
#             ~8 min alone), contexts $CONTEXTS (default 1024,4096,16384), batch $BATCH_SIZES (default 1,16,64),
#             k $KS (default 2,3,4,5,6); more options in $LONG_ARGS
#   serve     python -m specdec serve-bench on the gpu zoo: request latency against request rate on the Engine,
#             plain decoding, k = 1/3/5, GoodputPolicy and goodput-model (options in $SERVE_ARGS, e.g. "--loads 0.1,0.9")
#   policies  python -m benchmarks.policies (from the repository root) --batch-sizes $BATCH_SIZES (default 16)
#             with $POLICY_ARGS
#   demo      python -m specdec demo --preset gpu --device cuda
# The gpu zoo is built first when a part needs it (~3 min). Everything is written under a work
# folder and packed into $OUT/results.tgz after each part (the device returns at most 8 files);
# unpack it with `tar xzf results.tgz -C somewhere`. A call may run 10 minutes at most: pick parts
# that fit, and run further parts in later calls on the same warm machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 SPECDEC_ZOO_DIR=${SPECDEC_ZOO_DIR:-/tmp/zoo}
RETURNED=${OUT:-/tmp/out}; WORK=/tmp/specdec_gpu_run; rm -rf "$WORK"; mkdir -p "$RETURNED" "$WORK"
pack() { tar czf "$RETURNED/results.tgz" -C "$WORK" .; }
trap pack EXIT
PARTS=${PARTS:-tests}
has() { [[ " $PARTS " == *" $1 "* ]]; }
quiet() { grep -v -i -E "warn|Loading weights|dynamo|generation_config"; }
{ python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; } | tee "$WORK/versions.txt"
TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E "h100|h200" | head -1 | tr 'A-Z' 'a-z')
TAG=${TAG:-gpu}
if has tests; then
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${TEST_WORKERS:-4}")
  timeout 480 python3 -m pytest -q -m cuda -p no:cacheprovider $workers 2>&1 | tee "$WORK/cuda_tests.log" | tail -25; pack
fi
if has quick || has bench || has trees || has verifiers || has serve || has policies || has demo; then  # the gpu zoo
  timeout 300 python3 -m specdec zoo build --preset gpu --device cuda 2>&1 | tr '\r' '\n' \
    | grep -v -E "Writing model|Loading weights|it/s" | tail -6 | tee "$WORK/zoo_build.log"
  cp "$SPECDEC_ZOO_DIR/gpu/manifest.json" "$WORK/zoo_gpu_manifest_$TAG.json"; pack
fi
has quick && { python3 -m specdec bench --quick --out "$WORK" 2>&1 | tee "$WORK/bench_quick.log" | quiet | tail -30; pack; }
has bench && { python3 -m specdec bench --out "$WORK" 2>&1 | tee "$WORK/bench.log" | quiet | tail -40; pack; }
has bandwidth && { timeout ${BANDWIDTH_TIMEOUT:-540} python3 -m specdec bench --quick --parts bandwidth --device cuda \
  --out "$WORK" 2>&1 | tee "$WORK/bandwidth.log" | quiet | tail -20; pack; }
has host && { (cd "$(dirname "$0")/.." && PYTHONPATH=. timeout ${HOST_TIMEOUT:-300} python3 experiments/host_critical_path.py \
  --compile --out "$WORK/host_critical_path.json") 2>&1 | tee "$WORK/host.log" | quiet | tail -20; pack; }
if has hostprof; then
  for k in 0 4; do (cd "$(dirname "$0")/.." && PYTHONPATH=. timeout ${HOST_TIMEOUT:-200} python3 experiments/host_step_profile.py \
    --shape zoo-gpu --compile --k $k --top 45 --out "$WORK/host_profile_zoo_k$k.json") 2>&1 | quiet \
    | tee "$WORK/host_profile_zoo_k$k.txt" | head -30; pack; done
fi
has trees && { timeout ${TREES_TIMEOUT:-540} python3 -m specdec bench --parts trees --no-peers --batch-sizes "${BATCH_SIZES:-1,4,16,64}" \
  --temperatures "${TEMPERATURES:-0,0.8}" --repeats "${REPEATS:-3}" ${TREES_ARGS:-} \
  --out "$WORK" 2>&1 | tee "$WORK/trees.log" | quiet | tail -60; pack; }
has verifiers && { timeout ${VERIFIERS_TIMEOUT:-540} python3 -m specdec bench --parts verifiers --no-peers \
  --batch-sizes "${BATCH_SIZES:-1,16,64}" --repeats "${REPEATS:-3}" --out "$WORK" 2>&1 | tee "$WORK/verifiers.log" \
  | quiet | tail -40; pack; }
has pipeline && { timeout ${PIPELINE_TIMEOUT:-540} python3 -m specdec bench --parts pipeline --no-peers \
  --batch-sizes "${BATCH_SIZES:-16,64}" --repeats "${REPEATS:-3}" --out "$WORK" 2>&1 | tee "$WORK/pipeline.log" \
  | quiet | tail -30; pack; }
has tp && { (cd "$(dirname "$0")/.." && timeout ${TP_TIMEOUT:-540} torchrun --standalone \
  --nproc_per_node "${TP_NPROC:-2}" benchmarks/tensor_parallel_bench.py --device cuda --out "$WORK" \
  ${TP_ARGS:-}) 2>&1 | tee "$WORK/tp.log" | quiet | tail -30; pack; }
if has long; then
  timeout ${LONG_BUILD_TIMEOUT:-560} python3 -m specdec zoo build --preset gpu-long --device cuda 2>&1 | tr '\r' '\n' \
    | grep -v -E "Writing model|Loading weights|it/s" | tail -8 | tee "$WORK/zoo_build_long.log"
  cp "$SPECDEC_ZOO_DIR/gpu-long/manifest.json" "$WORK/zoo_gpu_long_manifest_$TAG.json" 2>/dev/null
  cp "$SPECDEC_ZOO_DIR/gpu-long/spire/manifest.json" "$WORK/zoo_gpu_long_spire_manifest_$TAG.json" 2>/dev/null; pack
  [ -n "${LONG_BUILD_ONLY:-}" ] || { timeout ${LONG_TIMEOUT:-540} python3 -m specdec bench --long-context \
    --contexts "${CONTEXTS:-1024,4096,16384}" --batch-sizes "${BATCH_SIZES:-1,16,64}" --ks "${KS:-2,3,4,5,6}" \
    ${LONG_ARGS:-} --out "$WORK" 2>&1 | tee "$WORK/long.log" | quiet | tail -60; pack; }
fi
has serve && { timeout ${SERVE_TIMEOUT:-540} python3 -m specdec serve-bench --preset gpu --device cuda ${SERVE_ARGS:-} \
  --out "$WORK" 2>&1 | tee "$WORK/serve.log" | quiet | tail -60; pack; }
has policies && { (cd "$(dirname "$0")/.." && python3 -m benchmarks.policies --preset gpu --device cuda --batch-sizes "${BATCH_SIZES:-16}" \
  ${POLICY_ARGS:---num-prompts 16 --history-prompts 8 --pass-calls 2 --repeats 3 --time-limit-s 300} \
  --name "policies_$TAG" --out "$WORK") 2>&1 | tee "$WORK/policies.log" | quiet | tail -30; pack; }
has demo && { python3 -m specdec demo --preset gpu --device cuda --json "$WORK/demo_gpu.json" 2>&1 \
  | tee "$WORK/demo_gpu.log" | quiet; pack; }
exit 0
