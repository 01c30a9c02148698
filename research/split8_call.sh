#!/usr/bin/env bash
# One device call of the eighth protocol's runs at lr 1e-3 (research/preregistration/
# early-warning-protocol-8.md and its second execution note). On the device machine, from the
# repository root, with the registered code's `git archive` copy in .devrun/p8 (carried; its
# CODE_COMMIT beside it):
#   bash research/split8_call.sh            (the same command again continues the runs)
# The pilot (seeds 510-517) runs alone, 8 in parallel under CUDA MPS: a 16-run probe on 2026-12-03
# took 111.2 ms/step, too slow for 20,000 steps in one machine lifetime. With SPLIT8_PROBE=1 the first
# call on a machine probes 16 parallel runs again (seeds 900-915, 300 steps, timing only) and chooses
# the pilot together with the test's first block (600-607) if a step then takes at most SPLIT8_MAX_MS ms
# (default 52: 20,000 steps in ~1,040 s of the ~1,200 a session's calls leave); later calls on the same
# machine keep the choice (in /tmp). Runs checkpoint on the machine only: start them on a fresh
# machine and call back to back until none is paused (about 950 s of training in all). Each call
# trains for what its 600 s leave (SPLIT_SECONDS overrides), checkpointing on the device, and returns
# the recordings of the runs that finished in it, packed by research.recordings (xz, four runs an
# archive: within the 16 MiB a returned file may have), the runner's JSON and the log. The console
# shows run states only.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROOT=$PWD
export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1
[ -e flashwatch/kernels ] || ln -s ../kernels flashwatch/kernels
[ -f .devrun/p8/CODE_COMMIT ] || { echo "no .devrun/p8 (the registered code's git archive copy): carry it"; exit 2; }
source research/mps_env.sh
CHOICE=/tmp/split8-choice
if [ ! -s "$CHOICE" ] && [ "${SPLIT8_PROBE:-0}" != 1 ]; then
  echo "510-517 8 111.2(2026-12-03)" > "$CHOICE"
elif [ ! -s "$CHOICE" ]; then
  PROBE_MODES=mps PROBE_KEEP_MPS=1 PROBE_PARALLEL=16 PROBE_STEPS=300 bash benchmarks/mps_probe.sh | tee /tmp/probe16.txt
  MS=$(grep -o '^mps: [0-9]* runs, ms/step median [0-9.]*' /tmp/probe16.txt | awk '{print $NF}')
  if python3 -c "import sys; sys.exit(0 if 0 < float('${MS:-0}') <= float('${SPLIT8_MAX_MS:-52}') else 1)"; then
    echo "510-517,600-607 16 ${MS}" > "$CHOICE"
  else
    echo "510-517 8 ${MS:-none}" > "$CHOICE"
  fi
fi
read -r SEEDS PARALLEL PROBED < "$CHOICE"
# SPLIT8_SEEDS / SPLIT8_PARALLEL override the choice for this call (e.g. 510-513 at 4: runs short
# enough to finish within one call, so that a machine lost between calls loses nothing finished)
SEEDS=${SPLIT8_SEEDS:-$SEEDS} PARALLEL=${SPLIT8_PARALLEL:-$PARALLEL}
echo "split8 at lr 1e-3: seeds $SEEDS, $PARALLEL in parallel under MPS (16-run probe: ${PROBED} ms/step)" | tee "$OUT/split8-choice.txt"
# what the call may train: its 600 s less the start so far and 100 s for checkpoints and packing
LEFT=${SPLIT_SECONDS:-$(( 600 - SECONDS - 100 ))}
(cd .devrun/p8 && ln -sfn ../kernels flashwatch/kernels && \
  SPLIT8_LR=0.001 SPLIT_SEEDS=$SEEDS SPLIT_PARALLEL=$PARALLEL SPLIT_SECONDS=$LEFT bash research/gpu_batch.sh split8-pilot) \
  | grep -E '^\[|^paused|^resume|^code|^plan|failed'
rm -f "$OUT"/seed-split-pilot8-runs-*.tgz  # the runner's per-call archives: replaced by the xz ones below
# the runs that finished in this call (completed or blown up; a paused run lives only on this machine and
# is worth nothing without it), four an archive, each run once
python3 - "$OUT" <<'PY' | {
import json, pathlib, sys
done_list = pathlib.Path("/tmp/split8-packed")
packed = set(done_list.read_text().split()) if done_list.exists() else set()
new = [str(p.parent) for p in sorted(pathlib.Path("/tmp/fw-seed-split/pilot8").glob("*/*/seed*/run.json"))
       if json.loads(p.read_text()).get("status") in ("completed", "blown_up") and str(p.parent) not in packed]
for i in range(0, len(new), 4):
    print(" ".join(new[i:i + 4]))
done_list.write_text("\n".join(sorted(packed | set(new))) + "\n")
PY
  while read -r group; do
    python3 -m research.recordings pack $group --out "$OUT/runs-$(echo $group | sed 's#[^ ]*/seed##g; s# #-#g').tar.xz" &
  done
  wait
}
ls -la "$OUT"
