#!/usr/bin/env bash
# Do parallel training runs on one GPU go faster when they share it through CUDA MPS?
# Eight short runs of the seed-split recipe (the pre-registered experiments' model, seeds 900-907:
# timing only, no claim uses them), first as separate processes time-slicing the GPU, then with the
# MPS control daemon started (kernels of different processes may then run side by side); prints
# the median ms/step of each. The GPU's settings are left as they are; the daemon is stopped after.
#   bash benchmarks/mps_probe.sh        (on the device machine, from the repository root)
# PROBE_ARM, PROBE_STEPS (default 500), PROBE_PARALLEL (default 8) change the runs; PROBE_MODES
# (default "separate mps") which of the two run; PROBE_KEEP_MPS=1 leaves the daemon running.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -e flashwatch/kernels ] || ln -s ../kernels flashwatch/kernels
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
ARM=${PROBE_ARM:-sdpa_observe_lr0.00125}
STEPS=${PROBE_STEPS:-500}
N=${PROBE_PARALLEL:-8}
probe() {  # NAME: the runs, then their median ms/step from each run's run.json
  rm -rf "/tmp/probe-$1"
  timeout 260 python3 -m research.experiments seed-split --arms "$ARM" --seeds "900-$((899 + N))" \
    --max-steps "$STEPS" --parallel "$N" --budget 250 --out "/tmp/probe-$1" > "$OUT/mps_probe_$1.log" 2>&1
  python3 - "$1" <<'PY'
import json, pathlib, statistics, sys
name = sys.argv[1]
ms = [json.loads(p.read_text()).get("ms_per_step") for p in pathlib.Path(f"/tmp/probe-{name}").rglob("run.json")]
ms = [m for m in ms if m]
print(f"{name}: {len(ms)} runs, ms/step median {statistics.median(ms):.1f} (min {min(ms):.1f}, max {max(ms):.1f})"
      if ms else f"{name}: no run finished (log: mps_probe_{name}.log)")
PY
}
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader
MODES=${PROBE_MODES:-separate mps}
[[ " $MODES " == *" separate "* ]] && probe separate
if [[ " $MODES " == *" mps "* ]]; then
  source research/mps_env.sh
  if [ -n "$MPS_CONTROL" ]; then
    probe mps
    [ -n "${PROBE_KEEP_MPS:-}" ] || echo quit | "$MPS_CONTROL"
    tail -5 "$CUDA_MPS_LOG_DIRECTORY"/control.log 2> /dev/null
  fi
fi
