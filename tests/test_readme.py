"""The README is the user's manual: short, in the user's words, and true of the code.

Checked here: its two Python snippets run; every path it names exists; every `flashwatch ...`
command line it shows parses; the MonitorConfig defaults and metric names it quotes are the
code's; every alert rule is in its table; it stays short; and neither it nor the docs this test
guards speak the project's internal language or point at files users do not have.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import shlex

import pytest

from flashwatch.cli import build_parser
from flashwatch.config import MonitorConfig
from flashwatch.detectors import RULES
from flashwatch.metrics import ALL_METRICS

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# The docs held to the same language as the README (docs/KERNEL_TUNING.md, a measurement log,
# says "issue" and "sitting" in their hardware and plain-English senses).
USER_DOCS = ["README.md", "docs/GUIDE.md", "docs/SIGNALS.md", "docs/EXPERIMENTS.md", "docs/PERFORMANCE.md",
             "docs/DISTRIBUTED.md", "docs/INTERFACES.md", "docs/CALIBRATION.md", "docs/LAB.md",
             "results/INDEX.md"]
# Words of the project's working notes, not of a user's manual; and paths users do not have.
INTERNAL = re.compile(r"\bsessions?\b|\bsittings?\b|\bissues?\b|\bprobes?\b|\bthe lead\b|\.\./shared|/work/shared",
                      re.IGNORECASE)


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def test_the_readme_is_short():
    assert len(README.splitlines()) <= 150, "the README is the manual's first page; details go to docs/"


@pytest.mark.parametrize("name", USER_DOCS)
def test_no_internal_words_and_no_paths_users_lack(name):
    text = (ROOT / name).read_text()
    # raw GPU logs are named by what ran (docs/gpu-runs/DATE-WHAT-COMMIT...), not held to the prose's words
    text = re.sub(r"gpu-runs/[\w{},.*-]+", "gpu-runs/FILE", text)
    found = sorted({m.group(0) for m in INTERNAL.finditer(text)})
    assert not found, f"{name} says {found}"


def test_named_paths_exist():
    spans = re.findall(r"`([^`\n]+)`", README) + re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    paths = {s for s in spans if re.fullmatch(r"(?:docs|examples|dashboards|results|research|flashwatch|benchmarks)"
                                              r"/[\w./-]*", s)}
    assert len(paths) >= 12, sorted(paths)
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert not missing, f"the README names {missing}"
    for target in ("demo:", "test:", "install:"):
        assert target in (ROOT / "Makefile").read_text(), target


@pytest.mark.parametrize("name", USER_DOCS)
def test_files_the_docs_name_exist(name):
    """Repository paths in code spans (`docs/LAB.md`, `research/`) and relative Markdown links."""
    text = (ROOT / name).read_text()
    named = [p for p in re.findall(r"`([^`\n]+)`", text)
             if re.fullmatch(r"(?:docs|examples|dashboards|results|research|flashwatch|benchmarks|kernels|tests)/"
                             r"(?:[\w.-]+/)*(?:[\w-]+\.\w+)?", p) and "ARM" not in p]
    linked = [str((ROOT / name).parent.joinpath(p).resolve().relative_to(ROOT))
              for p in re.findall(r"\]\(([^)#\s:]+)(?:#[^)]*)?\)", text)]
    missing = [p for p in named + linked if not (ROOT / p).exists()]
    assert not missing, f"{name} names {missing}"


def test_shown_command_lines_parse():
    lines = [line.split("#", 1)[0].strip() for block in _code_blocks(README, "bash") for line in block.splitlines()]
    lines += re.findall(r"`((?:\.venv/bin/)?flashwatch [^`]+)`", README)
    commands = [shlex.split(line.replace("<timestamp>", "20261130-101500"))
                for line in lines if re.match(r"(?:\.venv/bin/)?flashwatch ", line)]
    assert len(commands) >= 5
    parser = build_parser()
    for argv in commands:
        argv = argv[1:]
        if argv[0] == "experiment" or "--help" in argv:
            continue  # checked below / prints and exits
        parser.parse_args(argv)  # exits (SystemExit) on an unknown command or option


def test_experiment_analyze_is_a_command():
    from flashwatch.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["experiment", "analyze", "--help"])
    assert exit_.value.code == 0


def _value(text: str):
    return {"None": None, "True": True, "False": False}.get(text, text)


@pytest.mark.parametrize("doc, least", [("README.md", 2), ("docs/GUIDE.md", 3)])
def test_quoted_config_defaults_are_the_code_defaults(doc, least):
    """`field=value` in a code span is a default (keyword examples are quoted strings or sets)."""
    text_of_doc = (ROOT / doc).read_text()
    fields = {f.name for f in dataclasses.fields(MonitorConfig)}
    defaults = MonitorConfig()
    checked = 0
    for name, text in re.findall(r"`([a-z_0-9]+)=([^`(]+)`", text_of_doc):
        if name not in fields or text.startswith(('"', "{", "'")):
            continue  # a keyword example (auto_fix="fp32_delta"), not a default
        want = getattr(defaults, name)
        got = _value(text.strip())
        if isinstance(want, float):
            assert float(got) == want, f"{doc} says {name}={text}, MonitorConfig has {want}"
        else:
            assert str(got) == str(want), f"{doc} says {name}={text}, MonitorConfig has {want!r}"
        checked += 1
    assert checked >= least
    for name, text in re.findall(r"`(mode|variant)=\"(\w+)\"` \(default\)", text_of_doc):
        assert getattr(defaults, name) == text


def test_the_alert_table_is_the_vocabularys():
    table = README.split("## Alerts", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| \[`(\w+)`\]\(docs/ALERTS\.md#\1\) \| (warning|critical) \|", table, re.MULTILINE))
    assert set(RULES) <= set(rows), sorted(set(RULES) - set(rows))
    try:
        from flashwatch.vocabulary import markdown_table
    except ImportError:  # a tree without the vocabulary: the severities are the detectors'
        from flashwatch.detectors import build_detectors

        for detector in build_detectors(MonitorConfig()):
            assert rows[detector.rule] == detector.severity, detector.rule
        return
    assert markdown_table() in table, "README alert table is stale: `python -m flashwatch.vocabulary` prints it"


def test_metric_names_are_the_code_names():
    names = {m.name for m in ALL_METRICS}
    quoted = set(re.findall(r"`(flashwatch_\w+)`", README))
    assert quoted and quoted <= names, sorted(quoted - names)
    words = {"Eleven": 11, "Twelve": 12, "Thirteen": 13, "Fourteen": 14, "Fifteen": 15}
    said = re.search(r"(\w+) names, used by Prometheus", README)
    assert said, "the README no longer says how many metric names there are"
    count = int(said.group(1)) if said.group(1).isdigit() else words.get(said.group(1))
    assert count == len(ALL_METRICS), (said.group(0), len(ALL_METRICS))


def test_plain_loop_snippet_runs(tmp_path, monkeypatch):
    (snippet,) = [b for b in _code_blocks(README, "python") if "Monitor(" in b]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(snippet, "README.md (plain loop)", "exec"), scope)
    monitor = scope["monitor"]
    assert monitor.monitored_steps == 5 and monitor.errors == 0
    assert len(monitor.layers) == 2
    assert (tmp_path / "runs" / "my-run" / "metrics.jsonl").exists()  # what `flashwatch report` reads


def test_lightning_snippet_runs(tmp_path, monkeypatch):
    """The snippet as written, with a small model and data for `model` and `datamodule`; the
    Trainer is held to 12 CPU steps without logger or checkpoints, the server to a free port."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import flashwatch.lightning
    from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

    (snippet,) = [b for b in _code_blocks(README, "python") if "FlashWatchCallback(" in b]

    class LitGPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=32))

        def training_step(self, batch, batch_idx):
            return self.model(*batch)[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    x, y = sample_batch(stdlib_corpus(100_000), 96, 32, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    trainer_cls, callback_cls = pl.Trainer, flashwatch.lightning.FlashWatchCallback

    def small_trainer(**kwargs):
        kwargs.update(max_steps=12, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
        return trainer_cls(**kwargs)

    monkeypatch.setattr(pl, "Trainer", small_trainer)
    monkeypatch.setattr(flashwatch.lightning, "FlashWatchCallback",
                        lambda **kw: callback_cls(**{**kw, "port": 0, "console": None}))
    monkeypatch.chdir(tmp_path)
    scope = {"model": LitGPT(), "datamodule": loader}
    exec(compile(snippet, "README.md (Lightning)", "exec"), scope)
    watch = scope["watch"]
    assert watch.monitor.monitored_steps == 2 and watch.monitor.errors == 0
    assert (tmp_path / "runs" / "my-lit-run" / "metrics.jsonl").exists()


def test_the_guide_names_tests_that_exist():
    """docs/GUIDE.md backs each reliability promise with a named test: each must exist."""
    import re
    guide = (ROOT / "docs" / "GUIDE.md").read_text()
    named = re.findall(r"`(tests/test_\w+\.py)::(test_\w+)`", guide)
    assert len(named) >= 10
    for path, name in named:
        assert f"def {name}(" in (ROOT / path).read_text(), f"{path}::{name} is named in docs/GUIDE.md but missing"
