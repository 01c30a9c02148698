#!/usr/bin/env bash
# The code a pre-registered protocol runs, as a `git archive` copy of its commit for the device machine
# (carried there; research/split_call.sh runs the protocol's runs from it):
#   bash research/registered_code.sh 34ad75c .devrun/reg      # the ninth protocol's code
#   bash research/registered_code.sh 441d05a .devrun/reg10    # the tenth's
# The copy leaves out results/ and docs/gpu-runs/ (recordings: megabytes the runs never read) and
# writes the full commit hash to DIR/CODE_COMMIT, which the runs' logs and results record.
set -euo pipefail
COMMIT=${1:?name the commit of the protocol}
DIR=${2:?name the folder for the copy, e.g. .devrun/reg}
FULL=$(git rev-parse --verify "$COMMIT^{commit}")
if [ -e "$DIR" ] && [ ! -f "$DIR/CODE_COMMIT" ]; then  # only an earlier copy is replaced
  echo "$DIR exists and is not a registered code copy (no CODE_COMMIT): choose another folder" >&2; exit 2
fi
rm -rf "$DIR"
mkdir -p "$DIR"
git archive "$FULL" | tar -x -C "$DIR" --exclude='results' --exclude='docs/gpu-runs'
echo "$FULL" > "$DIR/CODE_COMMIT"
echo "$DIR: code $FULL ($(du -sh "$DIR" | cut -f1))"
