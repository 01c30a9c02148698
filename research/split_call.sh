#!/usr/bin/env bash
# One device call of a pre-registered protocol's seed-split runs, on the device machine, from the
# repository root, with the registered code's `git archive` copy in $SPLIT_CODE (default .devrun/reg;
# carry that folder alone: .devrun/ also holds the analyses' git worktrees; made by
# `bash research/registered_code.sh COMMIT .devrun/reg`, its CODE_COMMIT beside it):
#   SPLIT9_LR=0.0025 SPLIT_SEEDS=520-527 bash research/split_call.sh split9-pilot
#   (the same command again continues paused runs)
# TARGET is a case of research/gpu_batch.sh (split8-pilot, split9-pilot, split9, split9-controls, ...);
# its variables (SPLIT_SEEDS, SPLIT8_LR, SPLIT9_LR, SPLIT11_LR, SPLIT_PARALLEL) pass through. The runs share the GPU
# through CUDA MPS (research/mps_env.sh). Each call trains for what its 600 s leave (less 100 s for
# checkpoints and packing; SPLIT_SECONDS overrides), checkpointing on the device: a paused run lives only
# on this machine, so call back to back until none is paused. It returns the recordings of the runs that
# finished in this call, packed by research.recordings (xz, four runs an archive, within the 16 MiB a
# returned file may have), the runner's JSON and its log. The console shows run states only (no rule's
# firing: protocols report outcomes before their analysis).
# Back on the development machine, `python -m research.record_call RETURNED_DIR --protocol N --stage pilot|test
# --seeds FIRST-LAST [--peak 1.75e-3]` files one block under results/seed-split-N/.
set -u
TARGET=${1:?name the research/gpu_batch.sh target, e.g. split9-pilot}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
ROOT=$PWD
CODE_DIR=${SPLIT_CODE:-.devrun/reg}
export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1
[ -e flashwatch/kernels ] || ln -s ../kernels flashwatch/kernels  # the analysis below imports the package from here
[ -f "$CODE_DIR/CODE_COMMIT" ] || { echo "no $CODE_DIR/CODE_COMMIT: make the registered code's copy with research/registered_code.sh COMMIT $CODE_DIR and carry it"; exit 2; }
source research/mps_env.sh
LEFT=${SPLIT_SECONDS:-$(( 600 - SECONDS - 100 ))}
(cd "$CODE_DIR" && ln -sfn ../kernels flashwatch/kernels && SPLIT_SECONDS=$LEFT bash research/gpu_batch.sh "$TARGET") \
  | grep -E '^\[|^paused|^resume|^code|^plan|failed'
rm -f "$OUT"/seed-split-*-runs-*.tgz  # the runner's per-call archives: replaced by the xz ones below
# the returned logs keep what the console shows (code, versions, machine, run states), not the runner's
# end-of-call summary of rule firings: a protocol reads no rule before its analysis
for log in "$OUT"/seed-split-*.log; do
  [ -f "$log" ] && grep -E '^\[|^paused|^resume|^code|^plan|failed|^torch|^NVIDIA|UTC' "$log" > "$log.tmp" && mv "$log.tmp" "$log"
done
# and the runner's JSON keeps each run's state, length and speed, not its alerts, baselines or aggregate
for js in "$OUT"/seed-split-*.json; do
  [ -f "$js" ] && python3 - "$js" <<'PY'
import json, sys
KEEP = ("key", "arm", "seed", "status", "error", "steps", "last_step", "max_steps", "wall_s", "ms_per_step", "device",
        "versions", "date", "parallel", "blowup_step", "blowup_confirmed_step", "final_loss", "monitored_steps")
path = sys.argv[1]
r = json.load(open(path))
runs = {k: {f: v.get(f) for f in KEEP if f in v} for k, v in r.get("runs", {}).items()}
json.dump({"kind": r.get("kind"), "updated": r.get("updated"), "machine": r.get("machine"), "runs": runs},
          open(path, "w"), indent=1)
PY
done
# the runs that finished in this call (completed or blown up), four an archive, each run once
python3 - <<'PY' | {
import json, pathlib
done_list = pathlib.Path("/tmp/split-packed")
packed = set(done_list.read_text().split()) if done_list.exists() else set()
new = [str(p.parent) for p in sorted(pathlib.Path("/tmp/fw-seed-split").glob("*/*/*/seed*/run.json"))
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
# the outcomes of this target's runs finished on this machine so far (blow-up steps and survivors, no rule:
# what a protocol reports before its analysis; paused runs are not among them, nor other targets' runs), so
# that the next call can be chosen without leaving the machine idle
TAG=$(ls "$OUT"/seed-split-*.json 2>/dev/null | head -1 | sed 's#.*/seed-split-\(.*\)\.json#\1#')
TAG_DIRS=$(grep "^/tmp/fw-seed-split/${TAG:-none}/" /tmp/split-packed 2>/dev/null)
if [ -n "$TAG_DIRS" ]; then
  python3 -m research.early_warning outcomes $TAG_DIRS --out "$OUT/outcomes.json" --markdown "$OUT/outcomes.md" \
    > /dev/null 2>&1 && head -1 "$OUT/outcomes.md"
fi
ls -la "$OUT"
