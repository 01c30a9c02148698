"""Run a pre-registered protocol's analysis exactly as its file states it, with the code of its commit.

A protocol file (``research/preregistration/early-warning-protocol-<N>.md``) fixes, in its
"## Analysis" section, one command ``python -m research.early_warning test RUNS... <options>`` and
says it runs with "the code of this file's commit". This module does that and nothing else, from
the repository root:

    python -m research.registered_analysis --protocol 9 --seeds 700-739 [--dry-run]

1. the commit that added the protocol file (``git log --diff-filter=A``): the registered code;
2. a ``git archive`` copy of it (``research/registered_code.sh``) in ``--code`` (default
   ``.devrun/analysis<N>``), reused when its ``CODE_COMMIT`` matches;
3. the test runs ``results/seed-split-<N>/test/seed<S>`` for every seed of ``--seeds``, unpacked
   from ``results/seed-split-<N>/test-runs-*.tar.xz`` where missing; a seed without a run folder
   stops everything before the analysis starts (the analysis runs once, on all registered runs);
4. the file's command, RUNS replaced by those folders, run in the copy (``PYTHONPATH`` there too, so
   its ``research/preregistration/`` files are the commit's), with ``results/`` linked to this
   checkout's: the runs are read and the results written here.

``--dry-run`` prints the commit and the command and checks the runs, without running anything.
Only protocols whose analysis is one ``research.early_warning test`` command are handled; the
others' (the tenth's auto_fix comparison) are run as their files state, by hand.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from research import recordings
from research.record_call import parse_seeds

_TEST_COMMAND = re.compile(r"`(python -m research\.early_warning test RUNS\.\.\.[^`]*)`")


def protocol_file(root: Path, protocol: int) -> Path:
    path = root / "research" / "preregistration" / f"early-warning-protocol-{protocol}.md"
    if not path.exists():
        raise ValueError(f"no protocol {protocol}: {path} does not exist")
    return path


def analysis_command(text: str) -> list[str]:
    """The words of the "## Analysis" section's ``research.early_warning test`` command (RUNS... kept)."""
    start = text.find("## Analysis")
    if start < 0:
        raise ValueError("the protocol file has no '## Analysis' section")
    section = text[start:]
    nxt = section.find("\n## ", 3)
    m = _TEST_COMMAND.search(section if nxt < 0 else section[:nxt])
    if not m:
        raise ValueError("its analysis is not one `python -m research.early_warning test RUNS... ...` command: "
                         "run it by hand as the file states")
    return shlex.split(" ".join(m.group(1).split()))


def registered_commit(root: Path, path: Path) -> str:
    """The full hash of the commit that added ``path``."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", str(path.relative_to(root))],
                         cwd=root, capture_output=True, text=True, check=True).stdout.split()
    if not out:
        raise ValueError(f"{path} is not committed: a protocol counts only from its commit")
    return out[-1]


def test_runs(results: Path, protocol: int, seeds: list[int]) -> list[Path]:
    """Each seed's run folder, unpacking the test archives where a folder is missing."""
    folder = results / f"seed-split-{protocol}"
    runs = folder / "test"
    if any(not (runs / f"seed{s}").is_dir() for s in seeds):
        for archive in sorted(folder.glob("test-runs-*.tar.xz")):
            recordings.unpack(archive, runs)
    missing = [s for s in seeds if not (runs / f"seed{s}" / "run.json").exists()]
    if missing:
        raise ValueError(f"no test run for seeds {missing} under {runs} (nor in {folder}/test-runs-*.tar.xz): "
                         "the analysis runs once, on every registered test run")
    return [runs / f"seed{s}" for s in seeds]


def code_copy(root: Path, commit: str, into: Path) -> Path:
    marker = into / "CODE_COMMIT"
    if not (marker.exists() and marker.read_text().strip() == commit):
        subprocess.run(["bash", "research/registered_code.sh", commit, str(into)], cwd=root, check=True)
    kernels = into / "flashwatch" / "kernels"  # the copy's package imports its kernels through this link
    if kernels.parent.is_dir() and not kernels.exists():
        kernels.symlink_to(Path("..") / "kernels")
    return into


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.registered_analysis", description=__doc__.split("\n")[0])
    ap.add_argument("--protocol", type=int, required=True, help="the protocol's number (its file's N)")
    ap.add_argument("--seeds", required=True, help="the registered test seeds, FIRST-LAST (e.g. 700-739)")
    ap.add_argument("--code", type=Path, help="where the commit's copy goes (default .devrun/analysis<N>)")
    ap.add_argument("--results", type=Path, default=Path("results"), help="the results folder (default results/)")
    ap.add_argument("--dry-run", action="store_true", help="print the commit and command, check the runs, run nothing")
    args = ap.parse_args(argv)
    root = Path.cwd()
    try:
        path = protocol_file(root, args.protocol)
        words = analysis_command(path.read_text())
        commit = registered_commit(root, path)
        runs = test_runs(args.results, args.protocol, parse_seeds(args.seeds))
    except (ValueError, subprocess.CalledProcessError) as e:
        print(f"registered_analysis: {e}", file=sys.stderr)
        return 2
    at = words.index("RUNS...")
    # the command runs in the commit's copy, whose results/ is a link to --results: name the runs through it
    folders = [str(Path("results") / r.relative_to(args.results)) for r in runs]
    command = [sys.executable] + words[1:at] + folders + words[at + 1:]
    print(f"protocol {args.protocol}: code {commit}, {len(runs)} test runs")
    print(" ".join(shlex.quote(w) for w in command[:at]), f"<{len(runs)} run folders: {runs[0]} ...>",
          " ".join(shlex.quote(w) for w in command[at + len(runs):]))
    if args.dry_run:
        return 0
    copy = code_copy(root, commit, args.code or Path(".devrun") / f"analysis{args.protocol}").resolve()
    link = copy / "results"  # the command's results/ paths (runs in, results out) are --results
    if link.is_symlink() and link.resolve() != args.results.resolve():
        link.unlink()  # left by an earlier analysis with another --results
    if not link.is_symlink():
        link.symlink_to(args.results.resolve(), target_is_directory=True)
    env = dict(os.environ, PYTHONPATH=str(copy))
    return subprocess.run(command, cwd=copy, env=env).returncode  # research/preregistration/ from the commit


if __name__ == "__main__":
    sys.exit(main())
