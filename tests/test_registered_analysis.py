"""research.registered_analysis: a protocol's analysis command, with its commit's code, on every registered run."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from research import recordings, registered_analysis

ROOT = Path(__file__).resolve().parent.parent


def test_the_registered_test_command_is_read_from_the_protocol_files_analysis_section():
    words = registered_analysis.analysis_command(
        (ROOT / "research" / "preregistration" / "early-warning-protocol-9.md").read_text())
    assert words[:5] == ["python", "-m", "research.early_warning", "test", "RUNS..."]
    assert words[words.index("--horizon") + 1] == "10000" and "--require-complete" in words
    assert words[words.index("--protocol") + 1] == "research/preregistration/early-warning-protocol-9.md"
    assert words[words.index("--out") + 1] == "results/seed-split-9/test.json"


def test_the_tenth_protocols_auto_fix_command_is_read_with_its_two_placeholders():
    tenth = (ROOT / "research" / "preregistration" / "early-warning-protocol-10.md").read_text()
    words = registered_analysis.analysis_command(tenth)
    assert words[:6] == ["python", "-m", "research.auto_fix_effect", "FIX_RUNS", "--twins", "TWIN_RUNS"]
    assert words[words.index("--min-steps") + 1] == "10000" and "--loss-before-end" in words
    assert words[words.index("--out") + 1] == "results/seed-split-10/auto-fix.json"


def test_a_protocol_whose_analysis_is_another_command_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match="run it by hand"):
        registered_analysis.analysis_command("## Analysis\n\n`python -m research.other RUNS... --out x.json`\n")
    with pytest.raises(ValueError, match="no '## Analysis' section"):
        registered_analysis.analysis_command("# a protocol\n\n`python -m research.early_warning test RUNS... -x`\n")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


def _run_folder(path: Path, seed: int) -> Path:
    path.mkdir(parents=True)
    (path / "steps.csv").write_text("step,loss\n0,5.0\n")
    (path / "run.json").write_text(json.dumps({"seed": seed}))
    (path / "signals.jsonl").write_text("")
    return path


@pytest.fixture
def repo(tmp_path):
    """A repository with a protocol whose analysis writes what it was given, and its test runs packed."""
    repo = tmp_path / "repo"
    (repo / "research" / "preregistration").mkdir(parents=True)
    (repo / "research" / "__init__.py").write_text("")
    analysis = repo / "research" / "early_warning.py"
    # writes what it was given, and the commit its own `git rev-parse HEAD` names (what a result records)
    analysis.write_text("import json, subprocess, sys\nargs = sys.argv[1:]\nout = args[args.index('--out') + 1]\n"
                        "head = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True).stdout\n"
                        "json.dump({'code': 'registered', 'args': args, 'head': head.strip(),\n"
                        "           'frozen': open('research/preregistration/frozen.txt').read()}, open(out, 'w'))\n")
    (repo / "research" / "preregistration" / "frozen.txt").write_text("threshold 4.5")
    (repo / "research" / "auto_fix_effect.py").write_text(
        "import json, sys\nargs = sys.argv[1:]\njson.dump({'code': 'registered', 'args': args}, "
        "open(args[args.index('--out') + 1], 'w'))\n")
    (repo / "research" / "preregistration" / "early-warning-protocol-2.md").write_text(
        "# auto_fix against twins\n\n## Analysis\n\n`python -m research.auto_fix_effect FIX_RUNS --twins TWIN_RUNS\n"
        "--min-steps 10 --out results/seed-split-2/auto-fix.json` (this file's commit)\n")
    (repo / "research" / "preregistration" / "early-warning-protocol-1.md").write_text(
        "# protocol\n\n## Analysis\n\n`python -m research.early_warning test RUNS... --frozen\n"
        "research/preregistration/frozen.txt --thresholds research/preregistration/frozen.txt --protocol\n"
        "research/preregistration/early-warning-protocol-1.md --out results/seed-split-1/test.json` (this\n"
        "file's commit). Secondary: the landmark AUC (`python -m research.early_warning landmark ... --lead\n"
        "1000 --margin 500`).\n\n## After\n\n`landmark ... --lead 7 --margin 7`\n")
    _git(repo, "init", "-q")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "protocol 1")
    # changed after the protocol's commit: the analysis must not see either change
    analysis.write_text('raise SystemExit("the working tree code ran, not the commit code")\n')
    (repo / "research" / "preregistration" / "frozen.txt").write_text("threshold 9 (retuned)")
    folder = repo / "results" / "seed-split-1"
    runs = [_run_folder(tmp_path / "made" / f"seed{s}", s) for s in (200, 201, 202)]
    recordings.pack(runs[:2], folder / "test-runs-200-201.tar.xz")
    recordings.pack(runs[2:], folder / "test-runs-202-202.tar.xz")
    fixes = [_run_folder(tmp_path / "fixes" / f"seed{s}", s) for s in (200, 201, 202)]
    recordings.pack(fixes, repo / "results" / "seed-split-2" / "test-runs-200-202.tar.xz")
    return repo


def test_the_analysis_runs_the_protocol_commits_code_and_files_on_every_registered_run(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202"]) == 0
    out = json.loads((repo / "results" / "seed-split-1" / "test.json").read_text())
    assert out["code"] == "registered" and out["frozen"] == "threshold 4.5"
    runs = [a for a in out["args"] if a.startswith("results/seed-split-1/test/")]
    assert runs == [f"results/seed-split-1/test/seed{s}" for s in (200, 201, 202)]
    commit = _git(repo, "rev-parse", "HEAD").strip()
    assert out["head"] == commit  # the result names the registered commit, not whatever is checked out here
    assert f"code {commit}, 3 test runs" in capsys.readouterr().out
    assert not (repo / "results" / "seed-split-1" / "landmark.json").exists()  # only with --secondary


def test_the_worktree_follows_new_commits_of_this_checkout_but_stays_at_the_protocols(repo, monkeypatch):
    monkeypatch.chdir(repo)
    registered = _git(repo, "rev-parse", "HEAD").strip()
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "later work")
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202"]) == 0
    assert json.loads((repo / "results" / "seed-split-1" / "test.json").read_text())["head"] == registered
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202"]) == 0  # the worktree reused


def test_an_earlier_archive_copy_is_replaced_and_a_foreign_folder_refused(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    old = repo / ".devrun" / "analysis1"
    old.mkdir(parents=True)
    (old / "CODE_COMMIT").write_text("0" * 40)
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202"]) == 0
    assert (old / ".git").is_file() and not (old / "CODE_COMMIT").exists()
    mine = repo / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202", "--code", str(mine)]) == 2
    assert "not a registered code worktree" in capsys.readouterr().err and (mine / "notes.txt").exists()


def test_secondary_runs_the_landmark_the_analysis_section_names_on_the_same_runs(repo, monkeypatch):
    monkeypatch.chdir(repo)
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202", "--secondary"]) == 0
    out = json.loads((repo / "results" / "seed-split-1" / "landmark.json").read_text())
    args = out["args"]
    assert [a for a in args if "/test/seed" in a] == [f"results/seed-split-1/test/seed{s}" for s in (200, 201, 202)]
    assert args[args.index("--lead") + 1] == "1000" and args[args.index("--margin") + 1] == "500"  # not "After"'s
    assert args[args.index("--thresholds") + 1] == "research/preregistration/frozen.txt"
    assert args[args.index("--markdown") + 1] == "results/seed-split-1/landmark.md"
    assert (repo / "results" / "seed-split-1" / "test.json").exists()


def test_the_registered_protocols_name_their_landmark():
    for n in (9, 11):
        text = (ROOT / "research" / "preregistration" / f"early-warning-protocol-{n}.md").read_text()
        words = registered_analysis.landmark_command(text, registered_analysis.analysis_command(text))
        assert words[words.index("--lead") + 1] == "1000" and words[words.index("--margin") + 1] == "1000"
        assert words[words.index("--out") + 1] == f"results/seed-split-{n}/landmark.json"


def test_a_missing_registered_run_stops_the_analysis_before_it_starts(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-203"]) == 2
    assert "no test run for seeds [203]" in capsys.readouterr().err
    assert not (repo / "results" / "seed-split-1" / "test.json").exists()
    assert not (repo / ".devrun").exists()


def test_an_uncommitted_protocol_is_refused(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    (repo / "research" / "preregistration" / "early-warning-protocol-3.md").write_text(
        "## Analysis\n\n`python -m research.early_warning test RUNS... --out results/x.json`\n")
    shutil.copytree(repo / "results" / "seed-split-1", repo / "results" / "seed-split-3")
    assert registered_analysis.main(["--protocol", "3", "--seeds", "200-202", "--dry-run"]) == 2
    assert "not committed" in capsys.readouterr().err


def test_results_kept_elsewhere_are_read_and_written_there(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(repo)
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202"]) == 0  # the link to results/ first
    elsewhere = tmp_path / "kept" / "results"
    shutil.copytree(repo / "results" / "seed-split-1", elsewhere / "seed-split-1",
                    ignore=shutil.ignore_patterns("test", "test.json"))
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202", "--results", str(elsewhere)]) == 0
    out = json.loads((elsewhere / "seed-split-1" / "test.json").read_text())
    assert [a for a in out["args"] if "/test/seed" in a] == [f"results/seed-split-1/test/seed{s}" for s in (200, 201, 202)]


def test_an_auto_fix_analysis_gets_its_runs_and_the_twins_protocols_runs_of_the_same_seeds(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    assert registered_analysis.main(["--protocol", "2", "--seeds", "200-202"]) == 2
    assert "--twins-protocol N" in capsys.readouterr().err
    assert registered_analysis.main(["--protocol", "1", "--seeds", "200-202", "--twins-protocol", "1"]) == 2
    assert "has none" in capsys.readouterr().err
    assert registered_analysis.main(["--protocol", "2", "--seeds", "200-202", "--twins-protocol", "1"]) == 0
    args = json.loads((repo / "results" / "seed-split-2" / "auto-fix.json").read_text())["args"]
    at = args.index("--twins")
    assert args[:at] == [f"results/seed-split-2/test/seed{s}" for s in (200, 201, 202)]
    assert args[at + 1:at + 4] == [f"results/seed-split-1/test/seed{s}" for s in (200, 201, 202)]
    assert args[at + 4:] == ["--min-steps", "10", "--out", "results/seed-split-2/auto-fix.json"]
