"""flashwatch report: HTML (inline SVG, self-contained) and PNG from the JSONL of a short real run."""

from __future__ import annotations

import json
import logging
import re
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
import torch

from flashwatch import Monitor, MonitorConfig
from flashwatch.cli import main as cli_main
from flashwatch.exporters.jsonl import JsonlExporter, read_jsonl
from flashwatch.report import HEATMAPS, MissingMatplotlib, UnreadableRun, load_run, render, to_html
from flashwatch.report.charts import bins, heatmap_grid
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

LAYERS, HEADS, STEPS = 2, 2, 24


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real (tiny) BF16 training run with the Monitor and the JSONL exporter; max_logit forced to alert."""
    path = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=LAYERS, n_head=HEADS, n_embd=32, block_size=32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # max_logit_bound below every logit: each head raises one alert at step 0; warm-up 4 so that
    # other rules may fire too
    monitor = Monitor(MonitorConfig(interval=2, warmup=4, window=3, max_logit_bound=-1e3),
                      exporters=[JsonlExporter(path)])
    monitor.attach(model)
    data = stdlib_corpus(200_000)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        x, y = sample_batch(data, 4, 32, generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        monitor.step(loss=loss.detach(), grad_norm=grad_norm)
    monitor.close()
    monitor.detach()
    assert len(monitor.alerts) >= LAYERS * HEADS
    return path


class _Balance(HTMLParser):
    """Checks that every non-void element is closed, in order."""

    VOID = {"meta", "link", "br", "hr", "img", "input", "col", "area", "base", "wbr", "source", "track", "embed"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def test_load_run_reads_columns(run_dir):
    run = load_run(run_dir)
    assert run.steps == list(range(0, STEPS, 2))
    assert run.rows == [(l, h) for l in range(LAYERS) for h in range(HEADS)]
    for hm in HEATMAPS:
        grid = run.series[hm.metric]
        assert len(grid) == LAYERS * HEADS and all(len(row) == len(run.steps) for row in grid)
    assert all(v == v for v in run.loss)
    assert {a["rule"] for a in run.alerts} >= {"max_logit"}
    assert not run.injected


def test_html_is_well_formed_self_contained_with_svgs_and_alert_markers(run_dir):
    out = render(run_dir)
    assert out == run_dir / "report.html"
    text = out.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")

    parser = _Balance()
    parser.feed(text)
    parser.close()
    assert not parser.errors and not parser.stack, (parser.errors, parser.stack)

    # self-contained: no scripts, no external files, no CDN
    assert "<script" not in text.lower()
    assert not re.search(r"""(src|href)\s*=\s*['"](?!#)""", text), "external reference"
    assert set(re.findall(r"https?://[^\s'\"<)]+", text)) <= {"http://www.w3.org/2000/svg"}

    # every SVG parses as XML: the loss chart and one heatmap per signal
    svgs = re.findall(r"<svg\b.*?</svg>", text, flags=re.S)
    assert len(svgs) == 1 + len(HEATMAPS)
    trees = [ET.fromstring(s) for s in svgs]
    ns = "{http://www.w3.org/2000/svg}"
    assert trees[0].get("id") == "loss-chart"
    assert [t.get("data-metric") for t in trees[1:]] == [h.metric for h in HEATMAPS]

    # alert markers on the loss: one per step where alerts started, with the alerts as tooltip
    run = load_run(run_dir)
    alert_steps = sorted({a["step"] for a in run.alerts})
    markers = [g for g in trees[0].iter(f"{ns}g") if g.get("class") == "alert-marker"]
    assert sorted(int(g.get("data-step")) for g in markers) == alert_steps
    assert all("max_logit" in g.find(f"{ns}title").text for g in markers if int(g.get("data-step")) == 0)
    # the max-logit heatmap outlines the cells of its alerts
    ml = trees[1 + [h.metric for h in HEATMAPS].index("flashwatch_max_logit")]
    cells = [g for g in ml.iter(f"{ns}g") if g.get("class") == "alert-cell"]
    assert len(cells) == sum(a["rule"] == "max_logit" for a in run.alerts)
    # one row label per head, the loss as a polyline
    assert "L1.H1" in svgs[1]
    assert trees[0].find(f"{ns}polyline") is not None
    # the alert table
    assert text.count("<tr>") >= 1 + len(run.alerts)


def test_injected_runs_say_so(run_dir, tmp_path):
    for name in ("metrics.jsonl",):
        (tmp_path / name).write_bytes((run_dir / name).read_bytes())
    (tmp_path / "demo.json").write_text(json.dumps({"injected": True, "inject_bias": 128.0,
                                                    "label": "INJECTED FAULT: test"}))
    text = to_html(load_run(tmp_path))
    assert "INJECTED" in text.split("<body>", 1)[1][:2000]
    assert "[INJECTED]" in text.split("</title>")[0]


def test_png_when_matplotlib_is_installed(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    out = render(run_dir, tmp_path / "run.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_png_without_matplotlib_says_what_to_install(run_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(MissingMatplotlib, match=r"PNG output needs matplotlib: pip install matplotlib"):
        render(run_dir, tmp_path / "run.png")
    assert not (tmp_path / "run.png").exists()


def test_cli(run_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    assert cli_main(["report", str(run_dir / "metrics.jsonl"), "--out", str(out)]) == 0
    assert out.exists() and f"wrote {out}" in capsys.readouterr().out
    assert cli_main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert cli_main(["report", str(run_dir), "--out", str(tmp_path / "r.pdf")]) == 2
    assert ".html (default) or .png" in capsys.readouterr().err


def test_resumed_steps_keep_the_last_record_and_long_runs_are_binned(run_dir, tmp_path):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    step_lines = [l for l in lines if '"kind":"step"' in l]
    # a resumed run appends an open record and repeats steps; the reader keeps the last of each
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines + [lines[0]] + step_lines[-2:]) + "\n")
    run = load_run(tmp_path)
    assert run.steps == sorted(set(run.steps)) and len(run.steps) == len(step_lines)
    assert len(list(read_jsonl(tmp_path))) == len(step_lines) + 2
    assert bins(10) == [(i, i + 1) for i in range(10)]
    ranges = bins(1000, 240)
    assert len(ranges) == 240 and ranges[0][0] == 0 and ranges[-1][1] == 1000
    assert all(a < b for a, b in ranges) and all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))


def test_binned_grid_keeps_extremes_and_alert_columns(run_dir):
    """The data both renderers draw: a column per bin of steps, the rule's combine per bin, alerts in their bin."""
    run = load_run(run_dir)
    drift, max_logit = HEATMAPS[0], next(h for h in HEATMAPS if h.metric == "flashwatch_max_logit")
    assert max_logit.metric == "flashwatch_max_logit" and max_logit.combine == "max"
    full = heatmap_grid(run, max_logit)
    assert not full.binned and full.columns == [(s, s) for s in run.steps]
    assert full.values == [list(row) for row in run.series[max_logit.metric]]
    half = heatmap_grid(run, max_logit, max_columns=len(run.steps) // 2)
    assert half.binned and len(half.columns) == len(run.steps) // 2
    for row, full_row in zip(half.values, run.series[max_logit.metric]):
        assert row[0] == max(full_row[0], full_row[1])
    assert {(row, col) for row, col, _, _ in half.cells} == {(row, col // 2) for row, col, _, _ in full.cells}
    lo, hi = heatmap_grid(run, drift).lo, heatmap_grid(run, drift).hi
    assert (lo, hi) == (-run.drift_threshold, run.drift_threshold)


def test_heatmap_step_labels_sit_under_their_own_columns(run_dir):
    """The x-axis labels of a heatmap (SVG and PNG share them) are monitored steps, each under its
    own column: the run monitors every 2nd step, so no label names a step it did not monitor, and
    each label's x is the middle of that step's column."""
    run = load_run(run_dir)
    hm = HEATMAPS[0]
    full = heatmap_grid(run, hm)
    ticks = full.step_ticks(8)
    assert ticks[0] == (0, "0") and len(ticks) >= 4
    assert all(label == str(run.steps[c]) for c, label in ticks)
    half = heatmap_grid(run, hm, max_columns=len(run.steps) // 2)  # binned: a column's first step
    assert all(label == str(half.columns[c][0]) for c, label in half.step_ticks(8))
    svg = next(s for s in re.findall(r"<svg\b.*?</svg>", render(run_dir).read_text(encoding="utf-8"), flags=re.S)
               if f"data-metric='{hm.metric}'" in s or f'data-metric="{hm.metric}"' in s)
    labels = re.findall(r"<text x='([0-9.]+)' y='[0-9.]+' text-anchor='middle' fill='#444'>([^<]+)</text>", svg)
    assert [label for _, label in labels] == [label for _, label in ticks]
    xs = [float(x) for x, _ in labels]
    gaps = {round(b - a, 1) / (cb - ca) for (a, b), (ca, cb) in
            zip(zip(xs, xs[1:]), zip([c for c, _ in ticks], [c for c, _ in ticks][1:]))}
    assert max(gaps) - min(gaps) < 0.2  # evenly placed by column: one column width per column


def test_the_cumulative_push_heatmap_spans_its_own_values_not_the_drift_threshold(run_dir):
    """The push is in its own units (often 1e-8 or less): a colour range of the drift threshold's
    +-4.5 would draw every cell white."""
    run = load_run(run_dir)
    push = next(h for h in HEATMAPS if h.metric == "flashwatch_wq_error_push_cumulative")
    values = [abs(v) for row in run.series[push.metric] for v in row if v == v]
    assert values and max(values) < 1e-2  # this tiny CPU run's pushes
    grid = heatmap_grid(run, push)
    assert (grid.lo, grid.hi) == (-max(values), max(values))


def test_an_out_path_in_a_missing_folder_names_that_folder(run_dir, tmp_path, capsys):
    missing = tmp_path / "nowhere" / "x.html"
    assert cli_main(["report", str(run_dir), "--out", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"no folder {missing.parent}" in err and ".tmp" not in err


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"this is not JSON\n\x00\xff garbage\n", "holds no step record"),
    (b'{"kind": "open", "layout": []}\n', "holds no step record"),
    (b'{"kind": "step", "step": "seven", "metrics": {}}\n', "not a flashwatch metrics.jsonl"),
])
def test_empty_or_unreadable_metrics_is_an_error_naming_the_file(tmp_path, capsys, content, message):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    with pytest.raises(UnreadableRun, match=message):
        load_run(tmp_path)
    assert cli_main(["report", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert str(path) in out.err and message in out.err and "No alert started" not in out.out + out.err
    assert not (tmp_path / "report.html").exists()


def test_a_metrics_file_that_cannot_be_opened_is_an_error(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").mkdir()  # a folder where the file should be
    assert cli_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    # named as a folder (before: "No such file or directory", of a metrics.jsonl inside it)
    assert "cannot read" in err and "metrics.jsonl: it is a folder, not a metrics.jsonl file" in err


def test_the_report_reads_the_thresholds_the_run_recorded(tmp_path):
    """A run's metrics.jsonl records its MonitorConfig in its open record, and the report draws and
    captions with those thresholds; a file without them says it shows the defaults."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
    monitor = Monitor(MonitorConfig(interval=1, drift_threshold=8.0, max_logit_bound=50.0),
                      exporters=[JsonlExporter(tmp_path)])
    monitor.attach(model)
    data = stdlib_corpus(20_000)
    for _ in range(2):
        x, y = sample_batch(data, 2, 16, generator=torch.Generator().manual_seed(0))
        model(x, y)[1].backward()
        monitor.step(loss=1.0)
    monitor.close()
    (opened,) = read_jsonl(tmp_path / "metrics.jsonl", kinds=("open",))
    assert opened["monitor_config"]["drift_threshold"] == 8.0
    run = load_run(tmp_path)
    assert run.thresholds_recorded and (run.drift_threshold, run.max_logit_bound) == (8.0, 50.0)
    html = to_html(run)
    assert "±8, the delta_drift threshold:" in html and "warns at 50." in html and "did not record" not in html
    # what ran, from the recorded config; no demo.json facts shown as "None" (fail before: "kernel None mode,
    # variant None, None on None, seed None" and an empty "run" line)
    from flashwatch.report.page import _facts
    facts = dict(_facts(run))
    assert facts["monitoring"] == "observe mode, interval 1"
    assert "run" not in facts and "None mode" not in html and "seed None" not in html

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    stripped = [json.dumps({k: v for k, v in json.loads(l).items() if k != "monitor_config"}) for l in lines]
    (tmp_path / "metrics.jsonl").write_text("\n".join(stripped) + "\n")  # as files written before
    old = load_run(tmp_path)
    assert not old.thresholds_recorded and old.drift_threshold == MonitorConfig().drift_threshold
    assert "did not record its own" in to_html(old)


def test_a_file_holding_two_runs_draws_the_last_with_a_warning_and_a_resumed_run_is_one(tmp_path, caplog):
    """A script run twice into one folder appends a second run from step 0: the report draws that run
    alone and says so; a resumed run (an open record, then steps after the first part's first) is
    drawn whole, without the warning."""
    def train(steps, monitor, seed):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16))
        monitor.attach(model)
        g = torch.Generator().manual_seed(seed)
        data = stdlib_corpus(50_000)
        for _ in range(steps):
            x, y = sample_batch(data, 2, 16, generator=g)
            _, loss = model(x, y)
            loss.backward()
            monitor.step(loss=loss.detach())
        monitor.close()

    train(6, Monitor(MonitorConfig(interval=2), exporters=[JsonlExporter(tmp_path)]), seed=0)
    first = load_run(tmp_path).steps
    train(4, Monitor(MonitorConfig(interval=2), exporters=[JsonlExporter(tmp_path)]), seed=1)
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        run = load_run(tmp_path)
    assert list(first) == [0, 2, 4] and list(run.steps) == [0, 2]
    assert sum("holds 2 runs" in r.getMessage() for r in caplog.records) == 1

    resumed = tmp_path / "resumed"
    monitor = Monitor(MonitorConfig(interval=2), exporters=[JsonlExporter(resumed)])
    train(4, monitor, seed=0)
    state = monitor.state_dict()
    again = Monitor(MonitorConfig(interval=2), exporters=[JsonlExporter(resumed)])
    again.load_state_dict(state)
    train(4, again, seed=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        assert list(load_run(resumed).steps) == [0, 2, 4, 6]
    assert not any("runs" in r.getMessage() and "holds" in r.getMessage() for r in caplog.records)


def test_a_cut_last_line_is_left_out_with_a_warning(run_dir, tmp_path, caplog):
    """A run that stopped mid-record: the report draws the whole records and says one was cut."""
    text = (run_dir / "metrics.jsonl").read_bytes()
    (tmp_path / "metrics.jsonl").write_bytes(text[:-40])  # the last record cut
    with caplog.at_level(logging.WARNING, logger="flashwatch"):
        code = cli_main(["report", str(tmp_path)])
    assert code == 0 and sum("the last line is cut" in r.getMessage() for r in caplog.records) == 1


def _synthetic_run(path, layers: int, heads: int, steps: int, alert=None):
    from flashwatch.exporters.testing import synthetic_layout, synthetic_record

    layout = synthetic_layout(layers, heads)
    exporter = JsonlExporter(path)
    exporter.open(layout)
    for step in range(steps):
        exporter.export(synthetic_record(layout, step, alerts=[alert] if alert is not None and step == 5 else []))
    exporter.close()
    return load_run(path)


def test_a_report_of_many_heads_stays_a_page_a_browser_opens(tmp_path):
    """GPT-2 small's 144 heads over 400 monitored steps: each heatmap at most MAX_CELLS cells (fewer
    columns), the page under 10 MB. Past MAX_HEAD_ROWS heads one row per layer holding its most extreme
    head, an alert on a head outlined in its layer's row, and the page says so. Fail before: 23 MB for
    GPT-2 small (values drawn at random: few neighbours merge), 164 MB for 32 x 32 heads."""
    from flashwatch.detectors import Alert
    from flashwatch.report.charts import MAX_CELLS, MAX_HEAD_ROWS

    run = _synthetic_run(tmp_path / "gpt2", 12, 12, 400)
    for hm in HEATMAPS:
        grid = heatmap_grid(run, hm)
        assert len(grid.rows) == 144 and len(grid.rows) * len(grid.columns) <= MAX_CELLS
    assert len(to_html(run).encode()) < 10e6

    alert = Alert(rule="max_logit", step=5, layer=3, head=7, value=101.0, threshold=100.0, severity="warning",
                  message="max logit")
    big = _synthetic_run(tmp_path / "big", 20, 16, 30, alert=alert)
    assert len(big.rows) == 320 > MAX_HEAD_ROWS
    max_logit = next(h for h in HEATMAPS if h.metric == "flashwatch_max_logit")
    grid = heatmap_grid(big, max_logit)
    assert grid.rows == [(layer, -1) for layer in range(20)] and grid.row_labels[3] == "L3"
    heads_of_3 = [big.series[max_logit.metric][3 * 16 + h] for h in range(16)]
    assert grid.values[3] == [max(column) for column in zip(*heads_of_3)]  # the layer's largest head, per step
    assert [(row, step) for row, _, step, _ in grid.cells] == [(3, 5)]
    assert "One row per layer" in to_html(big)


def test_a_long_run_is_read_without_holding_its_records(tmp_path):
    """The report keeps a run's numbers as arrays, not as the records' JSON objects: reading 100
    monitored steps of 144 heads (5 MB of JSONL) peaks below the file's size (before: 3.2 times it,
    so a run of 20,000 monitored steps took gigabytes)."""
    import tracemalloc

    from flashwatch.exporters.testing import synthetic_layout, synthetic_record

    layout = synthetic_layout(12, 12)
    exporter = JsonlExporter(tmp_path)
    exporter.open(layout)
    for s in range(100):
        exporter.export(synthetic_record(layout, step=10 * s, seed=s))
    exporter.close()
    size = (tmp_path / "metrics.jsonl").stat().st_size
    tracemalloc.start()
    try:
        run = load_run(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(run.steps) == 100 and len(run.rows) == 144
    assert peak < size, (peak, size)
