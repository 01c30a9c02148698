"""Record what one device call of ``research/split_call.sh`` returned, into ``results/seed-split-<protocol>/``.

A call returns its finished runs packed four an archive (``runs-<seed>-<seed>-...tar.xz``), the
runner's JSON (``seed-split-<tag>.json``, every run the machine has held so far) and its log
(``seed-split-<tag>.log``). This files one block of them under the names the index and the docs
use, from the repository root:

    python -m research.record_call RETURNED_DIR --protocol 11 --stage pilot --seeds 550-557 --peak 1.75e-3
    python -m research.record_call RETURNED_DIR --protocol 9 --stage test --seeds 724-731

- ``<stage>-runs-<first>-<last>.tar.xz``: the call's archives of these seeds, as returned;
- ``<stage>/seed<N>/``: each run unpacked (git-ignored: the analysis reads the run folders);
- ``seed-split-<stage><protocol>-<block>.json``: the runner's JSON with this block's runs only;
- ``<stage>-<block>.log``: the call's log;
- ``<stage>-outcomes-<block>.{json,md}``: ``research.early_warning outcomes`` on the block's runs
  (outcomes only: no rule is read, as a protocol requires before its analysis).

``<block>`` is the seed range for a test block and the peak (``1.75e-3``) for a pilot. Nothing
already in ``results/`` is overwritten: a name that exists stops the recording before it starts.
Every seed of the block must have come back finished; a paused run (continued by the next call
on the same machine) or a lost one is an error that names the seeds.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from research import early_warning, recordings, stated_numbers

_ARCHIVE = re.compile(r"runs-(\d+(?:-\d+)*)\.tar\.xz")


def parse_seeds(text: str) -> list[int]:
    """``"724-731"`` -> [724, ..., 731]; a single seed ``"724"`` -> [724]."""
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text.strip())
    if not m:
        raise ValueError(f"--seeds must be FIRST-LAST or one seed (e.g. 724-731), got {text!r}")
    first, last = int(m.group(1)), int(m.group(2) or m.group(1))
    if last < first:
        raise ValueError(f"--seeds {text}: the last seed is below the first")
    return list(range(first, last + 1))


def peak_label(peak: str) -> str:
    """A peak learning rate as the file names and docs write it: "0.00175" or "1.75e-3" -> "1.75e-3"."""
    try:
        value = float(peak)
    except ValueError:
        raise ValueError(f"--peak must be a learning rate such as 1.75e-3, got {peak!r}") from None
    if not 0 < value < 1:
        raise ValueError(f"--peak must be a learning rate between 0 and 1, got {peak!r}")
    return stated_numbers._rate(value)


def returned_archives(device_dir: Path) -> dict[Path, list[int]]:
    """The call's run archives and the seeds each holds (from its name)."""
    return {p: [int(s) for s in _ARCHIVE.fullmatch(p.name).group(1).split("-")]
            for p in sorted(device_dir.glob("runs-*.tar.xz")) if _ARCHIVE.fullmatch(p.name)}


def _one(device_dir: Path, pattern: str) -> Path:
    found = sorted(device_dir.glob(pattern))
    if len(found) != 1:
        raise ValueError(f"{device_dir}: expected one {pattern}, found {len(found)}")
    return found[0]


def plan(device_dir: Path, results: Path, protocol: int, stage: str, seeds: list[int],
         peak: str | None) -> dict[str, object]:
    """What will be written where; raises ValueError (with what is wrong) before anything is."""
    if stage not in ("pilot", "test"):
        raise ValueError(f"--stage must be pilot or test, got {stage!r}")
    if stage == "pilot" and not peak:
        raise ValueError("a pilot is recorded under its peak: give --peak (e.g. 1.75e-3)")
    block = peak_label(peak) if stage == "pilot" else f"{seeds[0]}-{seeds[-1]}"
    archives = {p: s for p, s in returned_archives(device_dir).items() if set(s) & set(seeds)}
    mixed = {p.name: s for p, s in archives.items() if not set(s) <= set(seeds)}
    if mixed:
        raise ValueError(f"archives hold seeds outside {seeds[0]}-{seeds[-1]}: {mixed}; record each block by itself")
    missing = sorted(set(seeds) - {s for ss in archives.values() for s in ss})
    if missing:
        raise ValueError(f"seeds {missing} did not come back finished from {device_dir} (paused or lost: "
                         "call again on the same machine, or rerun the block from step 0)")
    folder = results / f"seed-split-{protocol}"
    targets = {p: folder / f"{stage}-runs-{min(s)}-{max(s)}.tar.xz" for p, s in archives.items()}
    files = {"json": folder / f"seed-split-{stage}{protocol}-{block}.json", "log": folder / f"{stage}-{block}.log",
             "outcomes": folder / f"{stage}-outcomes-{block}.json", "markdown": folder / f"{stage}-outcomes-{block}.md"}
    existing = [str(p) for p in list(targets.values()) + list(files.values()) if p.exists()]
    if existing:
        raise ValueError(f"already recorded, not overwritten: {', '.join(existing)}")
    return {"folder": folder, "runs_into": folder / stage, "archives": targets, "files": files,
            "runner_json": _one(device_dir, "seed-split-*.json"), "log": _one(device_dir, "seed-split-*.log")}


def record(device_dir: Path, results: Path, protocol: int, stage: str, seeds: list[int],
           peak: str | None = None) -> dict:
    """File the block (see the module's docstring); returns its ``outcomes`` result."""
    p = plan(device_dir, results, protocol, stage, seeds, peak)
    p["folder"].mkdir(parents=True, exist_ok=True)
    for source, target in p["archives"].items():
        shutil.copyfile(source, target)
        recordings.unpack(target, p["runs_into"])
    runner = json.loads(p["runner_json"].read_text())
    runner["runs"] = {k: v for k, v in runner.get("runs", {}).items() if v.get("seed") in seeds}
    p["files"]["json"].write_text(json.dumps(runner, indent=1))
    shutil.copyfile(p["log"], p["files"]["log"])
    result = early_warning.outcomes([p["runs_into"] / f"seed{s}" for s in seeds])
    p["files"]["outcomes"].write_text(json.dumps(result, indent=1))
    p["files"]["markdown"].write_text(early_warning.outcomes_markdown(result) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("device_dir", type=Path, help="the folder the call's files came back in")
    ap.add_argument("--protocol", type=int, required=True, help="the protocol's number (results/seed-split-N)")
    ap.add_argument("--stage", required=True, choices=("pilot", "test"))
    ap.add_argument("--seeds", required=True, help="the block's seeds, FIRST-LAST")
    ap.add_argument("--peak", help="a pilot's peak learning rate (1.75e-3 or 0.00175; files are named 1.75e-3)")
    ap.add_argument("--results", type=Path, default=Path("results"), help="the results folder (default results/)")
    args = ap.parse_args(argv)
    try:
        result = record(args.device_dir, args.results, args.protocol, args.stage, parse_seeds(args.seeds), args.peak)
    except ValueError as e:
        print(f"record_call: {e}", file=sys.stderr)
        return 2
    print(early_warning.outcomes_markdown(result).split("\n")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
