#!/usr/bin/env bash
# The GPU batches of the experiments (python -m research.experiments) on a 2x H200 machine, from the
# repository root, without installing flashwatch (kernels/ is linked in as flashwatch/kernels, as
# benchmarks/gpu_session.sh does). Each batch fits in ~10 minutes; docs/EXPERIMENTS.md has their results.
#
#   bash research/gpu_batch.sh 1   # <= ~9.5 min: CUDA smoke of all arms (tiny), then
#                                  # real-failure seeds 0-1 x 6 arms + real-numerics paper seeds 0-1
#   bash research/gpu_batch.sh 2   # <= ~9 min: real-failure seeds 2-4 x (sdpa_observe, plain,
#                                  # fp32_delta, fp32) + real-numerics plain_fast/fp32_fast seed 0
#   bash research/gpu_batch.sh 3   # <= ~9.5 min: real-failure seeds 2-4: the five BF16 arms on GPU 0
#                                  # (15 runs), the FP32 control on GPU 1 (3 runs, as far as the
#                                  # budget takes them: TF32 off costs ~43 ms/step alone)
#   bash research/gpu_batch.sh 4   # <= ~9.5 min: GPU 0: kernel GPU tests and `flashwatch bench`
#                                  # (benchmarks/gpu_session.sh), then real-numerics plain_fast
#                                  # seeds 0-4; GPU 1: real-numerics paper seeds 2-4, fp32_fast 0-1
#   bash research/gpu_batch.sh 5   # <= ~8.5 min: GPU 0: kernel GPU tests, bench, host-overhead split
#                                  # (nothing else on that GPU); GPU 1: the FP32 control seeds 0-1
#                                  # again, to 5,000 steps (batch 1 stopped them at 2,280)
#   bash research/gpu_batch.sh 6   # <= ~9.5 min: GPU 0: the healthy BF16 reference
#                                  # sdpa_observe_lr1e-3 seeds 0-4 (delta from the rounded output);
#                                  # GPU 1: FP32 control seeds 2-3 to 5,000 steps (the GPU-0 half
#                                  # ran alone as batch 6; the FP32 half has not run)
#
#   bash research/gpu_batch.sh split-cal       # the seed-split calibration runs, one piece per call
#   bash research/gpu_batch.sh split-test      # the seed-split test runs (SPLIT_SEEDS=200-223)
#   bash research/gpu_batch.sh split-controls  # fp32 and fp32_delta at the seed-split lr, seeds 200-203
#   bash research/gpu_batch.sh split2-test     # the second protocol's test runs, lr 1.75e-3 (SPLIT_SEEDS=300-323)
#   bash research/gpu_batch.sh split2-controls # its fp32_delta controls, seeds 300-303
#   bash research/gpu_batch.sh split3          # the third protocol's runs to 20,000 steps (SPLIT_SEEDS: reruns or 340-347)
#   bash research/gpu_batch.sh split4          # the fourth protocol's runs, lr 1.5e-3, to 20,000 steps (SPLIT_SEEDS=400-415)
#   bash research/gpu_batch.sh split6          # the sixth protocol's auto_fix runs: seeds 400-407 at lr 1.5e-3, 13,000 steps
#   bash research/gpu_batch.sh split7          # the seventh protocol's controls: FP32 and fp32_delta, seeds 400,402,404,406, lr 1.5e-3
#                                              # (SPLIT7_ARMS=fp32_delta_lr0.0015 or fp32_lr0.0015: one arm per GPU run)
#   SPLIT8_LR=0.00125 SPLIT_SEEDS=500-507 bash research/gpu_batch.sh split8-pilot   # the eighth protocol's pilot
#   SPLIT8_LR=... SPLIT_SEEDS=600-607 bash research/gpu_batch.sh split8             # its test, block by block
#   SPLIT9_LR=0.0025 SPLIT_SEEDS=520-527 bash research/gpu_batch.sh split9-pilot    # the ninth protocol's pilot
#   SPLIT9_LR=... SPLIT_SEEDS=700-707 bash research/gpu_batch.sh split9             # its test, block by block
#   SPLIT9_LR=... bash research/gpu_batch.sh split9-controls                        # FP32 and fp32_delta, seeds 760-763
#   SPLIT9_LR=... SPLIT_SEEDS=700-707 bash research/gpu_batch.sh split10            # the tenth: auto_fix on those seeds
#   SPLIT11_LR=0.0015 SPLIT_SEEDS=540-547 bash research/gpu_batch.sh split11-pilot  # the eleventh protocol's pilot
#   SPLIT11_LR=... SPLIT_SEEDS=800-807 bash research/gpu_batch.sh split11           # its test, block by block
#   SPLIT11_LR=0.00175 SPLIT_SEEDS=808-815 bash research/gpu_batch.sh split12       # the twelfth: auto_fix on its seeds
#   (one device call of any of these, with MPS and packing: research/split_call.sh TARGET)
#   (eight parallel runs go 1.68x faster sharing the GPU through CUDA MPS: `source research/mps_env.sh` first)
#   bash research/gpu_batch.sh fp8             # the fp8-failure scenario, seeds 0-2 x 4 arms (12 runs on
#                                              # one GPU), one piece per call like split-*: the first call
#                                              # starts with a 20-step CUDA smoke of its arms
#
# What comes back under $OUT (at most 8 files): the results JSONs, the logs, and runs.tgz (every run
# folder: steps.csv, signals.jsonl.gz, run.json, worker.log). Run folders are written outside $OUT
# because only files at most two folders down come back. Render figures and re-analyse on your own
# machine: tar xzf runs.tgz -C runs/gpu && flashwatch experiment analyze runs/gpu --json ... and
# python -m research.experiments figures runs/gpu --out ...
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -e flashwatch/kernels ] || ln -s ../kernels flashwatch/kernels
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
RUNS=/tmp/fw-runs
fw() { python3 -m research.experiments "$@"; }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
# the code that runs: a checkout's HEAD, or CODE_COMMIT written beside a `git archive` copy
CODE="code: $(cat CODE_COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
VERSIONS=$(python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)")
echo "$CODE"; echo "$VERSIONS"
case "${1:-1}" in
split-cal|split-test|split-controls|split2-test|split2-controls|split3|split4|split6|split7|split8-pilot|split8|split9-pilot|split9|split9-controls|split10|split11-pilot|split11|split11-controls|split12)
  # the pre-registered seed-split runs (research/preregistration/), in pieces: each call trains every
  # unfinished run for SPLIT_SECONDS (default 480) and checkpoints it under $SPLIT_RUNS, which must
  # survive between calls on one device machine; the same command again continues them
  SPLIT_RUNS=${SPLIT_RUNS:-/tmp/fw-seed-split}
  case "$1" in
    split-cal) what=(--seeds 100-107); tag=calibration ;;
    split-test) what=(--seeds ${SPLIT_SEEDS:-200-223}); tag=test ;;
    split-controls) what=(--arms fp32,fp32_delta --seeds 200-203); tag=controls ;;
    split2-test) what=(--arms sdpa_observe_lr0.00175 --seeds ${SPLIT_SEEDS:-300-323}); tag=test2 ;;
    split2-controls) what=(--arms fp32_delta_lr0.00175 --seeds ${SPLIT_SEEDS:-300-303}); tag=controls2 ;;
    split3) what=(--arms sdpa_observe_lr0.00175 --seeds ${SPLIT_SEEDS:?name the seeds} --max-steps 20000); tag=test3 ;;
    split4) what=(--arms sdpa_observe_lr0.0015 --seeds ${SPLIT_SEEDS:-400-415} --max-steps 20000); tag=test4 ;;
    split6) what=(--arms auto_fix_lr0.0015 --seeds 400-407 --max-steps 13000); tag=test6 ;;
    split7) what=(--arms ${SPLIT7_ARMS:-fp32_lr0.0015,fp32_delta_lr0.0015} --seeds 400,402,404,406 --max-steps 13000); tag=test7 ;;
    # the eighth protocol: the pilot (SPLIT_SEEDS=500-507 at lr 1.25e-3, then 510-517 at 1e-3), then its test at
    # the rate the pilot chose (SPLIT8_LR=0.00125 or 0.001, SPLIT_SEEDS=600-607 ... 624-631)
    split8-pilot) what=(--arms sdpa_observe_lr${SPLIT8_LR:?name the rate: 0.00125 or 0.001} --seeds ${SPLIT_SEEDS:?name the seeds} --max-steps 20000); tag=pilot8 ;;
    split8) what=(--arms sdpa_observe_lr${SPLIT8_LR:?name the rate the pilot chose} --seeds ${SPLIT_SEEDS:?name the seeds} --max-steps 20000); tag=test8 ;;
    # the ninth protocol: peak rates of a cosine decay ending at step 10,000; its pilot (SPLIT9_LR=0.0025,
    # SPLIT_SEEDS=520-527; then 0.002 or 0.003 at 530-537), its test at the chosen peak (700-707 ... 716-723), the controls
    split9-pilot) what=(--arms sdpa_observe_cos${SPLIT9_LR:?name the peak: 0.0025, 0.002 or 0.003} --seeds ${SPLIT_SEEDS:?name the seeds} --max-steps 10000); tag=pilot9 ;;
    split9) what=(--arms sdpa_observe_cos${SPLIT9_LR:?name the peak the pilot chose} --seeds ${SPLIT_SEEDS:?name the seeds} --max-steps 10000); tag=test9 ;;
    # the tenth protocol: auto_fix on the ninth's first test seeds at the peak its pilot chose
    split10) what=(--arms auto_fix_cos${SPLIT9_LR:?name the peak the ninth protocol chose} --seeds ${SPLIT_SEEDS:-700-715} --max-steps 10000); tag=test10 ;;
    split9-controls) what=(--arms fp32_cos${SPLIT9_LR:?name the peak the pilot chose},fp32_delta_cos${SPLIT9_LR} --seeds ${SPLIT_SEEDS:-760-763} --max-steps 10000); tag=controls9 ;;
    # the eleventh protocol: lower peaks of the same schedule; its test in blocks of 8 from seed 800 (research.pilot.next_block)
    split11-pilot) what=(--arms sdpa_observe_cos${SPLIT11_LR:?name the peak: 0.0015, 0.00125 or 0.00175} --seeds ${SPLIT_SEEDS:?name the seeds} --max-steps 10000); tag=pilot11 ;;
    split11) what=(--arms sdpa_observe_cos${SPLIT11_LR:?name the peak the pilot chose} --seeds ${SPLIT_SEEDS:?name the block, e.g. 800-807} --max-steps 10000); tag=test11 ;;
    split11-controls) what=(--arms fp32_cos${SPLIT11_LR:?name the peak the pilot chose},fp32_delta_cos${SPLIT11_LR} --seeds ${SPLIT_SEEDS:-860-863} --max-steps 10000); tag=controls11 ;;
    split12) what=(--arms auto_fix_cos${SPLIT11_LR:?name the peak the eleventh protocol chose} --seeds ${SPLIT_SEEDS:-808-823} --max-steps 10000); tag=test12 ;;
  esac
  CHECKED=" test4 test6 test7 pilot8 test8 pilot9 test9 controls9 test10 pilot11 test11 controls11 test12 "  # protocols that count only fully measured runs
  if [[ "$CHECKED" == *" $tag "* ]] && [ ! -d "$SPLIT_RUNS/$tag" ]; then
    # the fourth protocol and those after it count only runs measured at every monitored step: check on this GPU first
    # that a Monitor resumed from a checkpoint mapped to cuda keeps measuring (the earlier runs' defect)
    python3 -m pytest -q -p no:cacheprovider tests/test_resume_gpu.py > /tmp/resume-check.log 2>&1 \
      || { tail -30 /tmp/resume-check.log; echo "resume check failed: not starting the runs"; exit 1; }
    RESUME="resume check: $(tail -1 /tmp/resume-check.log)"; echo "$RESUME"
  fi
  # the log starts with the code, the versions and the GPU: what ran where
  { echo "$CODE"; echo "$VERSIONS"; echo "${RESUME:-}"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } \
    > "$OUT/seed-split-$tag.log"
  fw seed-split "${what[@]}" --parallel ${SPLIT_PARALLEL:-8} --resumable --after-blowup 1000 \
     --max-seconds ${SPLIT_SECONDS:-480} --budget $(( ${SPLIT_SECONDS:-480} + 60 )) --out "$SPLIT_RUNS/$tag" \
     --json "$SPLIT_RUNS/seed-split-$tag.json" 2>&1 | tee -a "$OUT/seed-split-$tag.log" | grep -v "^  \|Warning"
  cp "$SPLIT_RUNS/seed-split-$tag.json" "$OUT/"
  # the recordings without checkpoints (what the claims need), every call, so nothing is lost; one
  # archive per ten seeds (seed20*, seed21*, ...), each under the 16 MiB a returned file may have
  # (20,000-step runs: one archive per three runs)
  if [ "$tag" = test3 ] || [[ "$CHECKED" == *" $tag "* && "$tag" != test6 ]]; then
    (cd "$SPLIT_RUNS/$tag" && ls -d */*/seed* | xargs -n 3 | while read -r group; do
       tar czf "$OUT/seed-split-$tag-runs-$(echo $group | sed 's#[^ ]*/seed##g; s# #-#g').tgz" --exclude=checkpoint.pt $group
     done)
  else
  for block in $(ls -d "$SPLIT_RUNS/$tag"/*/*/seed* 2>/dev/null | sed 's#.*/seed\([0-9]*\)[0-9]$#\1#' | sort -u); do
    (cd "$SPLIT_RUNS/$tag" && tar czf "$OUT/seed-split-$tag-runs-${block}x.tgz" --exclude=checkpoint.pt */*/seed${block}?)
  done
  fi
  ls -la "$OUT"
  exit 0
  ;;
fp8)
  # the real-failure recipe with P_bar V emulated in FP8 E4M3 (research/format_attention.py), 3 seeds x
  # (BF16 SDPA, fp8 plain, fp8 fp32_delta, fp8 rounded_sum); each call trains every unfinished run for
  # FP8_SECONDS (default 420) and checkpoints it under $FP8_RUNS (keep the device machine warm between
  # calls); the same command again continues them. 1,000 steps past a confirmed blow-up confirm it.
  FP8_RUNS=${FP8_RUNS:-/tmp/fw-fp8}
  if [ ! -d "$FP8_RUNS/runs" ]; then
    fw fp8-failure --tiny --seeds 0 --arms sdpa_observe,fp8_plain,fp8_fp32_delta,fp8_rounded_sum,fp8_fixed \
       --max-steps 20 --parallel 5 --budget 120 --out "$FP8_RUNS/smoke" --json "$OUT/fp8-smoke.json" \
       > "$OUT/fp8-smoke.log" 2>&1 || { tail -40 "$OUT/fp8-smoke.log"; echo "CUDA smoke failed"; exit 1; }
    tail -8 "$OUT/fp8-smoke.log"
  fi
  S=${FP8_SECONDS:-420}
  fw fp8-failure --seeds 0-2 --parallel ${FP8_PARALLEL:-12} --devices 0 --resumable --after-blowup 1000 \
     --max-seconds $S --budget $(( S + 60 )) --out "$FP8_RUNS/runs" --json "$FP8_RUNS/fp8-failure.json" 2>&1 \
     | tee "$OUT/fp8-failure.log" | grep -v "^  \|Warning"
  cp "$FP8_RUNS/fp8-failure.json" "$OUT/"
  tar czf "$OUT/fp8-failure-runs.tgz" --exclude=checkpoint.pt -C "$FP8_RUNS" runs
  ls -la "$OUT"
  exit 0
  ;;
1)
  # every arm's code path on CUDA in ~1 minute: stop here if anything fails
  fw real-failure --tiny --seeds 0 --max-steps 20 --parallel 6 --devices 0,1 --budget 110 \
     --out "$RUNS/smoke" --json "$OUT/smoke.json" > "$OUT/smoke.log" 2>&1 \
     || { tail -40 "$OUT/smoke.log"; echo "CUDA smoke failed: not starting the batch"; exit 1; }
  tail -10 "$OUT/smoke.log"
  fw early-warning --scenario real-numerics --arms paper@0-1 --parallel 2 --devices 0,1 --budget 440 \
     --out "$RUNS" --json "$OUT/early-warning-gpu.json" > "$OUT/real-numerics.log" 2>&1 &
  fw real-failure --seeds 0-1 --parallel 12 --devices 0,1 --budget 440 \
     --out "$RUNS" --json "$OUT/real-failure.json" 2>&1 | tee "$OUT/real-failure.log"
  wait
  tail -6 "$OUT/real-numerics.log"
  ;;
2)
  fw early-warning --scenario real-numerics --arms "plain_fast@0,fp32_fast@0" --parallel 2 --devices 0,1 \
     --budget 520 --out "$RUNS" --json "$OUT/early-warning-gpu.json" > "$OUT/real-numerics.log" 2>&1 &
  fw real-failure --seeds 2-4 --arms sdpa_observe,plain,fp32_delta,fp32 --parallel 12 --devices 0,1 --budget 520 \
     --out "$RUNS" --json "$OUT/real-failure.json" 2>&1 | tee "$OUT/real-failure.log"
  wait
  tail -6 "$OUT/real-numerics.log"
  ;;
3)
  fw real-failure --seeds 2-4 --arms fp32 --parallel 3 --devices 1 --budget 540 \
     --out "$RUNS" --json "$OUT/real-failure-fp32.json" > "$OUT/real-failure-fp32.log" 2>&1 &
  fw real-failure --seeds 2-4 --arms sdpa_observe,plain,fixed,fp32_delta,auto_fix --parallel 15 --devices 0 \
     --budget 540 --out "$RUNS" --json "$OUT/real-failure.json" 2>&1 | tee "$OUT/real-failure.log"
  wait
  tail -8 "$OUT/real-failure-fp32.log"
  ;;
4)
  fw early-warning --scenario real-numerics --arms "paper@2-4,fp32_fast@0-1" --parallel 5 --devices 1 \
     --budget 530 --out "$RUNS" --json "$OUT/early-warning-gpu-1.json" > "$OUT/real-numerics-1.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_session.sh tests bench
  fw early-warning --scenario real-numerics --arms "plain_fast@0-4" --parallel 5 --devices 0 \
     --budget $((530 - SECONDS)) --out "$RUNS" --json "$OUT/early-warning-gpu-0.json" > "$OUT/real-numerics-0.log" 2>&1
  wait
  tail -9 "$OUT/real-numerics-0.log"; tail -9 "$OUT/real-numerics-1.log"
  ;;
5)
  fw real-failure --seeds 0-1 --arms fp32 --parallel 2 --devices 1 --budget 480 \
     --out "$RUNS" --json "$OUT/real-failure-fp32.json" > "$OUT/real-failure-fp32.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=0 bash benchmarks/gpu_session.sh tests bench host
  wait
  tail -5 "$OUT/real-failure-fp32.log"
  ;;
6)
  fw real-failure --seeds 2-3 --arms fp32 --parallel 2 --devices 1 --budget 540 \
     --out "$RUNS" --json "$OUT/real-failure-fp32.json" > "$OUT/real-failure-fp32.log" 2>&1 &
  fw real-failure --seeds 0-4 --arms sdpa_observe_lr1e-3 --parallel 5 --devices 0 --budget 540 \
     --out "$RUNS" --json "$OUT/real-failure.json" 2>&1 | tee "$OUT/real-failure.log"
  wait
  tail -5 "$OUT/real-failure-fp32.log"
  ;;
*) echo "usage: bash research/gpu_batch.sh 1|2|3|4|5|6|split-cal|split-test|split-controls|split2-test|split2-controls|fp8"; exit 2 ;;
esac
tar czf "$OUT/runs.tgz" -C "$RUNS" --exclude=smoke . && ls -la "$OUT"
