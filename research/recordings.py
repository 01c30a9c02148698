"""Pack run folders into one compact archive for results/, and unpack them for analysis.

    python -m research.recordings pack RUN_DIR... --out results/NAME-runs.tar.xz
    python -m research.recordings unpack results/NAME-runs.tar.xz --into /tmp/runs

A run folder (research.experiments) holds steps.csv, signals.jsonl.gz, run.json, spec.json and
worker.log. The archive keeps all of them as recorded except that, in each monitored-step record of
signals.jsonl, the fields the replay recomputes from the others are dropped (``C``, ``z``, ``zw``:
the cumulative delta error and the drift z-scores, which flashwatch.step_signals rebuilds from the
per-step delta error ``e``), and signals.jsonl is stored uncompressed inside one xz stream, which
packs the JSON text of many runs about 1.5x smaller than one gzip file per run. Unpacking gives
folders that ``flashwatch experiment analyze`` and ``python -m research.early_warning`` read as they are.
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import tarfile
from pathlib import Path

from flashwatch.replay.records import SIGNALS_FILE

DERIVED_FIELDS = ("C", "z", "zw")
KEPT_FILES = ("steps.csv", "run.json", "spec.json", "worker.log")


def _slim_signals(run_dir: Path) -> bytes:
    """signals.jsonl of ``run_dir`` (gzip or plain) without the derived fields; lines kept in order."""
    gz, plain = run_dir / (SIGNALS_FILE + ".gz"), run_dir / SIGNALS_FILE
    raw = gzip.decompress(gz.read_bytes()) if gz.exists() else plain.read_bytes()
    out = []
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a killed run: kept as it is (the reader skips it)
            out.append(line)
            continue
        for key in DERIVED_FIELDS:
            rec.pop(key, None)
        # json round-trips floats exactly (shortest repr), so every kept value is unchanged
        out.append(json.dumps(rec, separators=(",", ":")).encode())
    return b"\n".join(out) + b"\n"


def pack(run_dirs: list[Path], out: Path, root: Path | None = None) -> None:
    """One tar.xz of ``run_dirs``, each under its own folder name (which must be unique), or under its
    path relative to ``root`` when given (for archives of several scenarios and arms)."""
    names = [str(d.relative_to(root)) if root is not None else d.name for d in run_dirs]
    if len(set(names)) != len(names):
        raise SystemExit(f"run folder names must be unique inside one archive, got {names}")
    for d in run_dirs:
        if not (d / "steps.csv").exists():
            raise SystemExit(f"{d} is not a run folder (no steps.csv)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for name_in_archive, d in sorted(zip(names, run_dirs)):
            for name in KEPT_FILES:
                if (d / name).exists():
                    tar.add(d / name, arcname=f"{name_in_archive}/{name}")
            data = _slim_signals(d)
            info = tarfile.TarInfo(f"{name_in_archive}/{SIGNALS_FILE}")
            info.size, info.mtime = len(data), int((d / "steps.csv").stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))


def unpack(archive: Path, into: Path) -> list[Path]:
    """Extract ``archive`` under ``into``; returns the run folders."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: refuse links and paths outside `into`
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
        names = sorted({str(Path(m.name).parent) for m in tar.getmembers() if m.isfile()})
    return [into / n for n in names]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.recordings", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="run folders -> one tar.xz")
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--root", type=Path, help="keep each run's path relative to this folder (default: its name)")
    u = sub.add_parser("unpack", help="tar.xz -> run folders")
    u.add_argument("archive", type=Path)
    u.add_argument("--into", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "pack":
        pack(args.runs, args.out, args.root)
        print(f"{args.out}: {len(args.runs)} runs, {args.out.stat().st_size / 2**20:.1f} MiB")
    else:
        for d in unpack(args.archive, args.into):
            print(d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
