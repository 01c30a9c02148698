"""Run a pre-registered protocol's analysis exactly as its file states it, with the code of its commit.

A protocol file (``research/preregistration/early-warning-protocol-<N>.md``) fixes, in its
"## Analysis" section, one command and says it runs with "the code of this file's commit": either
``python -m research.early_warning test RUNS... <options>`` (an alarm test) or
``python -m research.auto_fix_effect FIX_RUNS --twins TWIN_RUNS <options>`` (auto_fix against SDPA twins).
This module does that and nothing else, from the repository root:

    python -m research.registered_analysis --protocol 9 --seeds 700-739 [--secondary] [--dry-run]
    python -m research.registered_analysis --protocol 10 --seeds 700-715 --twins-protocol 9

1. the commit that added the protocol file (``git log --diff-filter=A``): the registered code;
2. a detached ``git worktree`` of it in ``--code`` (default ``.devrun/analysis<N>``), reused when it is
   at that commit: the analysis's own ``git rev-parse HEAD`` and ``git log`` then name the registered
   commit and the protocol's commit in its results (a ``git archive`` copy has no history, so they
   named this checkout's HEAD and nothing);
3. the test runs ``results/seed-split-<N>/test/seed<S>`` for every seed of ``--seeds``, unpacked
   from ``results/seed-split-<N>/test-runs-*.tar.xz`` where missing; a seed without a run folder
   stops everything before the analysis starts (the analysis runs once, on all registered runs);
   (FIX_RUNS: the same; TWIN_RUNS: the same seeds' test runs of ``--twins-protocol``);
4. the file's command, its placeholders replaced by those folders, run in the worktree (``PYTHONPATH`` there too,
   so its ``research/preregistration/`` files are the commit's), with its ``results/`` replaced by a
   link to this checkout's: the runs are read and the results written here.

``--secondary`` then runs the landmark AUC the section names (``landmark ... --lead L --margin M``) on
the same runs with the same thresholds, into ``results/seed-split-<N>/landmark.json`` and ``.md``.
``--dry-run`` prints the commit and the commands and checks the runs, without running anything.
A protocol whose analysis is another command is refused: run it by hand as its file states.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from research import recordings
from research.record_call import parse_seeds

_TEST_COMMAND = re.compile(r"`(python -m research\.early_warning test RUNS\.\.\.[^`]*)`")
_AUTO_FIX_COMMAND = re.compile(r"`(python -m research\.auto_fix_effect FIX_RUNS --twins TWIN_RUNS[^`]*)`")
_LANDMARK = re.compile(r"`(?:python -m research\.early_warning )?landmark[^`]*?--lead (\d+) --margin (\d+)`")


def protocol_file(root: Path, protocol: int) -> Path:
    path = root / "research" / "preregistration" / f"early-warning-protocol-{protocol}.md"
    if not path.exists():
        raise ValueError(f"no protocol {protocol}: {path} does not exist")
    return path


def _analysis_section(text: str) -> str:
    start = text.find("## Analysis")
    if start < 0:
        raise ValueError("the protocol file has no '## Analysis' section")
    section = text[start:]
    nxt = section.find("\n## ", 3)
    return section if nxt < 0 else section[:nxt]


def analysis_command(text: str) -> list[str]:
    """The words of the "## Analysis" section's command (its placeholders kept): the
    ``research.early_warning test`` one, or else the ``research.auto_fix_effect`` one."""
    section = _analysis_section(text)
    m = _TEST_COMMAND.search(section) or _AUTO_FIX_COMMAND.search(section)
    if not m:
        raise ValueError("its analysis is neither `python -m research.early_warning test RUNS... ...` nor "
                         "`python -m research.auto_fix_effect FIX_RUNS --twins TWIN_RUNS ...`: "
                         "run it by hand as the file states")
    return shlex.split(" ".join(m.group(1).split()))


def landmark_command(text: str, test_words: list[str]) -> list[str]:
    """The secondary landmark AUC the "## Analysis" section names, as one ``research.early_warning landmark``
    command on the test's RUNS..., thresholds and protocol file, written beside the test's ``--out``."""
    m = _LANDMARK.search(" ".join(_analysis_section(text).split()))
    if not m:
        raise ValueError("its analysis names no landmark AUC (`landmark ... --lead L --margin M`)")
    def option(name: str) -> str:
        if name not in test_words:
            raise ValueError(f"its test command has no {name}: the landmark needs it")
        return test_words[test_words.index(name) + 1]
    out = Path(option("--out")).with_name("landmark.json")
    return ["python", "-m", "research.early_warning", "landmark", "RUNS...", "--thresholds", option("--thresholds"),
            "--lead", m.group(1), "--margin", m.group(2), "--protocol", option("--protocol"),
            "--out", str(out), "--markdown", str(out.with_suffix(".md"))]


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


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


def code_worktree(root: Path, commit: str, into: Path) -> Path:
    """A detached worktree of ``commit`` at ``into`` (made, or reused when already at it), its results/ a link
    to be set by the caller. An earlier ``git archive`` copy there (a ``CODE_COMMIT`` file, no ``.git``)
    is replaced; any other folder is refused."""
    into = into.resolve()
    if into == root.resolve() or root.resolve().is_relative_to(into):
        raise ValueError(f"--code {into} is this checkout: name a folder for the commit's worktree")
    if (into / ".git").is_file() and _git(into, "rev-parse", "HEAD").stdout.strip() == commit:
        pass  # already at the commit
    elif (into / ".git").is_file() or (into / "CODE_COMMIT").is_file():
        shutil.rmtree(into)  # an earlier worktree at another commit, or an earlier archive copy
        _git(root, "worktree", "prune")
    elif into.exists():
        raise ValueError(f"{into} exists and is not a registered code worktree: choose another --code folder")
    if not (into / ".git").is_file():
        into.parent.mkdir(parents=True, exist_ok=True)
        made = _git(root, "worktree", "add", "--detach", "--force", str(into), commit)
        if made.returncode:
            raise ValueError(f"git worktree add {into} {commit} failed: {made.stderr.strip()}")
    kernels = into / "flashwatch" / "kernels"  # the package imports its kernels through this link
    if kernels.parent.is_dir() and not kernels.exists():
        kernels.symlink_to(Path("..") / "kernels")
    return into


def link_results(copy: Path, results: Path) -> None:
    """The worktree's results/ (the commit's recordings, or an earlier link) becomes a link to ``results``."""
    link = copy / "results"
    if link.is_symlink():
        if link.resolve() == results.resolve():
            return
        link.unlink()  # left by an earlier analysis with another --results
    elif link.is_dir():
        shutil.rmtree(link)  # the worktree's own checkout of results/, never this checkout's
    link.symlink_to(results.resolve(), target_is_directory=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.registered_analysis", description=__doc__.split("\n")[0])
    ap.add_argument("--protocol", type=int, required=True, help="the protocol's number (its file's N)")
    ap.add_argument("--seeds", required=True, help="the registered test seeds, FIRST-LAST (e.g. 700-739)")
    ap.add_argument("--code", type=Path, help="where the commit's worktree goes (default .devrun/analysis<N>)")
    ap.add_argument("--results", type=Path, default=Path("results"), help="the results folder (default results/)")
    ap.add_argument("--twins-protocol", type=int,
                    help="whose test runs of the same seeds are the twins (a TWIN_RUNS analysis: the tenth's is 9)")
    ap.add_argument("--secondary", action="store_true",
                    help="then run the landmark AUC the protocol's analysis names, into landmark.json/.md")
    ap.add_argument("--dry-run", action="store_true", help="print the commit and command, check the runs, run nothing")
    args = ap.parse_args(argv)
    root = Path.cwd()
    try:
        path = protocol_file(root, args.protocol)
        text = path.read_text()
        words = analysis_command(text)
        commands = [words] + ([landmark_command(text, words)] if args.secondary else [])
        commit = registered_commit(root, path)
        seeds = parse_seeds(args.seeds)
        runs = {"RUNS...": test_runs(args.results, args.protocol, seeds)}
        runs["FIX_RUNS"] = runs["RUNS..."]
        if "TWIN_RUNS" in words:
            if args.twins_protocol is None:
                raise ValueError("its analysis compares with twins (TWIN_RUNS): name whose test runs they are with "
                                 "--twins-protocol N, as the protocol file says (the tenth's: 9)")
            runs["TWIN_RUNS"] = test_runs(args.results, args.twins_protocol, seeds)
        elif args.twins_protocol is not None:
            raise ValueError("--twins-protocol is for an analysis with twins (TWIN_RUNS); this one has none")
    except (ValueError, subprocess.CalledProcessError) as e:
        print(f"registered_analysis: {e}", file=sys.stderr)
        return 2
    # the commands run in the commit's worktree, whose results/ is a link to --results: name the runs through it
    folders = {k: [str(Path("results") / r.relative_to(args.results)) for r in v] for k, v in runs.items()}
    print(f"protocol {args.protocol}: code {commit}, {len(runs['RUNS...'])} test runs")
    resolved = []
    for w in commands:
        resolved.append([sys.executable] + [x for word in w[1:] for x in folders.get(word, [word])])
        print(" ".join(f"<{len(folders[word])} run folders: {folders[word][0]} ...>" if word in folders
                       else shlex.quote(word) for word in [sys.executable] + w[1:]))
    if args.dry_run:
        return 0
    try:
        copy = code_worktree(root, commit, args.code or Path(".devrun") / f"analysis{args.protocol}")
    except ValueError as e:
        print(f"registered_analysis: {e}", file=sys.stderr)
        return 2
    link_results(copy, args.results)
    env = dict(os.environ, PYTHONPATH=str(copy))
    for command in resolved:  # research/preregistration/ from the commit
        rc = subprocess.run(command, cwd=copy, env=env).returncode
        if rc:
            return rc
    return 0

if __name__ == "__main__":
    sys.exit(main())
