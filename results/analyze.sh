#!/usr/bin/env bash
# Rebuild every results JSON, table, calibration and figure of docs/EXPERIMENTS.md from the
# recordings kept in results/ (no training, no GPU; ~10 min on 2 CPU cores), from the repository root
# of a checkout (the figures come from research/, which is not installed):
#
#   bash results/analyze.sh            # PYTHON=/path/to/python to choose the interpreter
#
# Recordings (run folders: steps.csv, signals.jsonl, run.json, worker.log; packed by research.recordings):
#   results/gpu-2026-11-30/runs-batch1.tar.xz   GPU batch 1: real-failure sdpa_observe, real-numerics paper
#                                            (its plain, fixed, fp32_delta and auto_fix runs were INVALID:
#                                            dK/dV layout bug, fixed since; left out with its fp32 runs)
#   results/gpu-2026-11-30/runs-batch2.tar.xz   GPU batch 2: plain, fixed, fp32_delta, auto_fix (after the fix)
#   results/gpu-2026-11-30/runs-batch3.tar.xz   GPU batch 3: real-failure seeds 2-4, all six arms
#   results/gpu-2026-11-30/runs-batch4.tar.xz   GPU batch 4: real-numerics paper seeds 2-4, plain_fast 0-4, fp32_fast 0-1
#   results/gpu-2026-11-30/runs-batch5.tar.xz   GPU batch 5: real-failure fp32 seeds 0-1 again, to ~4,830 steps
#                                            (they replace batch 1's fp32 runs of the same seeds, stopped at 2,280)
#   results/gpu-2026-11-30/runs-batch6.tar.xz   GPU batch 6: real-failure sdpa_observe_lr1e-3 seeds
#                                            0-4, the healthy BF16 reference, to ~4,940 steps
#   results/injection-2026-11-30/runs.tgz    CPU injection scenario: healthy, injected (and the first
#                                            injected_auto_fix runs, made with the old defaults)
#   results/injection-2026-11-30/runs-auto_fix-calibrated.tgz
#                                            CPU injected_auto_fix rerun with the calibrated defaults
set -eu
PY=${PYTHON:-python}
fw() { "$PY" -m flashwatch.cli experiment "$@"; }               # the product's replay
figures() { "$PY" -m research.experiments figures "$@" --out docs/figures; }
G=runs/gpu-2026-11-30
I=runs/injection-2026-11-30
mkdir -p $G/batch1 $G/batch2 $G/batch3 $G/batch4 $G/batch5 $G/batch6 $I/original $I/calibrated
tar xJf results/gpu-2026-11-30/runs-batch1.tar.xz -C $G/batch1
tar xJf results/gpu-2026-11-30/runs-batch2.tar.xz -C $G/batch2
tar xJf results/gpu-2026-11-30/runs-batch3.tar.xz -C $G/batch3
tar xJf results/gpu-2026-11-30/runs-batch4.tar.xz -C $G/batch4
tar xJf results/gpu-2026-11-30/runs-batch5.tar.xz -C $G/batch5
tar xJf results/gpu-2026-11-30/runs-batch6.tar.xz -C $G/batch6
tar xzf results/injection-2026-11-30/runs.tgz -C $I/original
tar xzf results/injection-2026-11-30/runs-auto_fix-calibrated.tgz -C $I/calibrated

REAL_FAILURE="$G/batch1/real-failure/sdpa_observe $G/batch5/real-failure/fp32 $G/batch2/real-failure $G/batch3/real-failure"
REAL_NUMERIC="$G/batch1/real-numerics $G/batch4/real-numerics"
INJECTION="$I/original/injection/healthy $I/original/injection/injected $I/calibrated/injection/injected_auto_fix"

rm -f results/real-failure.json results/early-warning-gpu.json results/early-warning.json
fw analyze $REAL_FAILURE --json results/real-failure.json --min-lead real-failure=1000 --markdown results/real-failure-table.md
figures $REAL_FAILURE
fw analyze $REAL_NUMERIC --json results/early-warning-gpu.json --markdown results/early-warning-gpu-table.md
figures $REAL_NUMERIC
fw analyze $INJECTION --json results/early-warning.json --markdown results/early-warning-table.md
figures $INJECTION
# the default thresholds' evidence (margins, sweeps, baselines at other thresholds): the GPU
# recordings, the CPU ones, and all of them together
fw analyze $REAL_FAILURE $REAL_NUMERIC --calibrate results/calibration-gpu.json > results/calibration-gpu.txt
# the real failure alone (lr 3e-3): its healthy runs are the FP32 controls and fp32_delta; the
# real-numerics pool adds the lr-6e-3 FP32 runs, whose logits pass 2e4 (docs/EXPERIMENTS.md section 2)
fw analyze $REAL_FAILURE --calibrate results/calibration-real-failure.json > results/calibration-real-failure.txt
# the real failure with the healthy BF16 reference (SDPA at lr 1e-3, delta from the rounded output)
fw analyze $REAL_FAILURE $G/batch6/real-failure --calibrate results/calibration-real-failure-healthy-bf16.json \
   > results/calibration-real-failure-healthy-bf16.txt
fw analyze $INJECTION --calibrate results/calibration-injection.json > results/calibration-injection.txt
fw analyze $REAL_FAILURE $REAL_NUMERIC $INJECTION --calibrate results/calibration.json > results/calibration.txt
