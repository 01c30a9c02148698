"""FlashWatchCallback in real CPU Lightning runs of a tiny GPT: metrics over HTTP, JSONL, alerts,
resume, precision, gradient accumulation, logging, errors."""

from __future__ import annotations

import json
import logging
import math
import socket
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from same import assert_same
from flashwatch.exporters.jsonl import ALERTS_FILE, METRICS_FILE, read_jsonl, validate_record
from flashwatch.exporters.prometheus import PortInUseError
from flashwatch.lightning import FlashWatchCallback
from flashwatch.metrics import METRICS
from flashwatch.tinygpt import GPT, GPTConfig, sample_batch, stdlib_corpus

LAYERS, HEADS = 2, 4
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's few-workers hints


class LitGPT(LightningModule):
    """A tiny byte-level GPT (head dim 16) that records what the callback should see."""

    def __init__(self, lr: float = 3e-3):
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(n_layer=LAYERS, n_head=HEADS, n_embd=64, block_size=32))
        self.lr = lr
        self.losses: dict[int, float] = {}       # batch index in the run -> loss
        self.grad_norms: dict[int, float] = {}   # optimizer step -> norm before clipping
        self.batches = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        _, loss = self.model(x, y)
        self.losses[self.batches] = loss.item()
        self.batches += 1
        return loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.grad_norms[self.trainer.global_step] = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


@pytest.fixture(scope="module")
def loader():
    data = stdlib_corpus(100_000)
    g = torch.Generator().manual_seed(0)
    xs, ys = zip(*(sample_batch(data, 4, 32, generator=g) for _ in range(6)))
    return DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=4)  # 6 batches per epoch


def trainer(callbacks, *, max_epochs=2, **kwargs):
    kwargs.setdefault("logger", False)
    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, callbacks=callbacks,
                   enable_progress_bar=False, enable_model_summary=False, **kwargs)


class Scrape(Callback):
    """Reads /metrics over a real socket at the end of training, while the server still runs."""

    def __init__(self, watch):
        self.watch, self.text, self.url = watch, None, None

    def on_train_end(self, trainer, pl_module):
        self.url = self.watch.url
        with urllib.request.urlopen(self.url, timeout=10) as r:
            self.text = r.read().decode()


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_metrics_jsonl_and_a_forced_alert(precision, loader, tmp_path, caplog):
    # a bound every head's max logit is above: each head raises one alert that holds all run
    watch = FlashWatchCallback(interval=2, port=0, run_dir=tmp_path, console="log", max_logit_bound=-1e3)
    scrape = Scrape(watch)
    with caplog.at_level(logging.INFO, logger="flashwatch"):
        trainer([watch, scrape], precision=precision).fit(LitGPT(), loader)
    assert watch.monitor.global_step == 12 and watch.monitor.errors == 0

    # /metrics over HTTP: every metric of the table, per-head ones for every (layer, head)
    families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
    values = {}
    for spec in METRICS:
        fam = families[spec.name[: -len("_total")] if spec.kind == "counter" else spec.name]
        samples = [s for s in fam.samples if not s.name.endswith("_created")]
        assert samples, spec.name
        for s in samples:
            assert set(s.labels) == set(spec.labels), spec.name
        if spec.per_head:
            assert {(s.labels["layer"], s.labels["head"]) for s in samples} == {
                (str(l), str(h)) for l in range(LAYERS) for h in range(HEADS)}, spec.name
        values[spec.name] = samples
    assert values["flashwatch_step"][0].value == 10
    assert 0 < values["flashwatch_loss"][0].value < 10 and values["flashwatch_grad_norm"][0].value > 0
    for name in ("flashwatch_repeated_max_ratio", "flashwatch_repeated_max_ratio_bf16"):
        assert all(0 <= s.value <= 1 for s in values[name]), name
    assert all(s.value > 0 and math.isfinite(s.value) for s in values["flashwatch_wq_spectral_norm"])
    assert all(math.isfinite(s.value) for s in values["flashwatch_delta_drift_z"])
    active = {s.labels["layer"]: s.labels["variant"] for s in values["flashwatch_kernel_variant"] if s.value == 1}
    assert active == {"0": "sdpa", "1": "sdpa"}  # observe mode: the model's own attention
    totals = {s.labels["rule"]: s.value for s in values["flashwatch_alerts_total"]}
    assert totals["max_logit"] == LAYERS * HEADS and sum(totals.values()) == LAYERS * HEADS

    # the forced alert: once per head in the log, the counter, the JSONL and the alert log
    logged = [r.getMessage() for r in caplog.records if "flashwatch alert [max_logit]" in r.getMessage()]
    assert len(logged) == LAYERS * HEADS
    assert len({m.split(":")[1] for m in logged}) == LAYERS * HEADS  # "layer L head H" each once
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    for line in lines:
        validate_record(json.loads(line))
    steps = list(read_jsonl(tmp_path))
    assert [r["step"] for r in steps] == list(range(0, 12, 2))
    new = [(a["layer"], a["head"]) for r in steps for a in r["new_alerts"]]
    assert sorted(new) == [(l, h) for l in range(LAYERS) for h in range(HEADS)]
    assert all(a["rule"] == "max_logit" for r in steps for a in r["new_alerts"])
    assert len((tmp_path / ALERTS_FILE).read_text().splitlines()) == LAYERS * HEADS

    # the server is closed at fit end
    assert watch.url is None
    with pytest.raises(OSError):
        urllib.request.urlopen(scrape.url, timeout=2)




def test_resumed_run_equals_uninterrupted_run(loader, tmp_path):
    config = dict(interval=2, port=None, console=None, max_logit_bound=0.5, warmup=2)
    whole = FlashWatchCallback(run_dir=tmp_path / "whole", **config)
    trainer([whole], max_epochs=4).fit(LitGPT(), loader)

    first = FlashWatchCallback(run_dir=tmp_path / "parts", **config)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    trainer([first, ckpt], max_epochs=2, enable_checkpointing=True).fit(LitGPT(), loader)
    resumed = FlashWatchCallback(run_dir=tmp_path / "parts", **config)
    trainer([resumed], max_epochs=4).fit(LitGPT(), loader, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))

    assert first.monitor.global_step == 12
    assert resumed.monitor.global_step == whole.monitor.global_step == 24
    assert_same(whole.monitor.snapshot(), resumed.monitor.snapshot(), "snapshot")
    assert_same(whole.monitor.state_dict(), resumed.monitor.state_dict())
    whole_steps = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "whole")}
    parts_steps = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "parts")}
    assert sorted(parts_steps) == sorted(whole_steps) == list(range(0, 24, 2))
    for step in whole_steps:
        for name in ("flashwatch_delta_error_cumulative", "flashwatch_delta_drift_z", "flashwatch_alerts_total",
                     "flashwatch_wq_spectral_norm"):
            assert parts_steps[step][name] == whole_steps[step][name], (step, name)


def test_gradient_accumulation_counts_optimizer_steps(loader, tmp_path):
    watch = FlashWatchCallback(interval=2, port=None, console=None, run_dir=tmp_path)
    module = LitGPT()
    trainer([watch], max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=1e-3).fit(module, loader)
    assert watch.monitor.global_step == 6  # 12 batches, 2 per optimizer step
    snap = watch.monitor.snapshot()
    assert snap["flashwatch_step"] == 4
    # the step's loss is the mean over its two micro-batches (batches 8 and 9)
    assert snap["flashwatch_loss"] == pytest.approx((module.losses[8] + module.losses[9]) / 2, rel=1e-6)
    # the gradient norm before clipping (clipping to 1e-3 happens after)
    assert snap["flashwatch_grad_norm"] == pytest.approx(module.grad_norms[4], rel=1e-5)
    assert snap["flashwatch_grad_norm"] > 1e-2
    assert [r["step"] for r in read_jsonl(tmp_path)] == [0, 2, 4]


class Recorder(Logger):
    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    name = "recorder"
    version = 0

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_summaries_go_to_the_trainer_loggers_at_each_monitored_step(loader, tmp_path):
    """Every monitored step once, under its own step number (the JSONL's), whatever
    log_every_n_steps is: never an older monitored step's values under a later step."""
    logger = Recorder()
    watch = FlashWatchCallback(interval=2, port=None, console=None, run_dir=tmp_path)
    trainer([watch], logger=logger, log_every_n_steps=5).fit(LitGPT(), loader)
    ours = [(step, m) for step, m in logger.logged if any(k.startswith("flashwatch/") for k in m)]
    records = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path)}
    assert [step for step, _ in ours] == sorted(records) == [0, 2, 4, 6, 8, 10]
    for step, m in ours:
        assert m["flashwatch/grad_norm"] == pytest.approx(records[step]["flashwatch_grad_norm"], rel=1e-6)
    keys = set(ours[0][1])
    assert keys == {"flashwatch/max_abs_drift_z", "flashwatch/max_repeated_max_ratio",
                    "flashwatch/max_repeated_max_ratio_bf16", "flashwatch/max_wq_spectral_norm",
                    "flashwatch/max_logit", "flashwatch/grad_norm", "flashwatch/alerts_total",
                    "flashwatch/alerts_active"}
    assert all(isinstance(v, float) for v in ours[0][1].values())


def test_while_monitoring_fails_the_summaries_are_not_measured_not_stale(loader, tmp_path):
    """From the monitored step where flashwatch starts failing, the loggers get NaN for every
    measured summary (the alert counts stay) and trainer.callback_metrics drops them: an older
    step's values never pass for the current ones. Training is unchanged."""
    logger = Recorder()
    watch = FlashWatchCallback(interval=2, port=None, console=None, run_dir=tmp_path)

    class BreakAt(Callback):  # monitoring breaks from batch 6 on (as a state on the wrong device did)
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 6:
                watch.monitor._signals.build = lambda **kw: 1 / 0

    t = trainer([watch, BreakAt()], logger=logger, log_every_n_steps=5)
    t.fit(LitGPT(), loader)
    ours = {step: m for step, m in logger.logged if any(k.startswith("flashwatch/") for k in m)}
    assert sorted(ours) == [0, 2, 4, 6, 8, 10]
    for step in (0, 2, 4):
        assert all(math.isfinite(v) for v in ours[step].values())
    for step in (6, 8, 10):  # each failed monitored step under its own number, not measured
        late = ours[step]
        assert math.isnan(late["flashwatch/max_logit"]) and math.isnan(late["flashwatch/grad_norm"])
        assert math.isfinite(late["flashwatch/alerts_total"])
    assert watch.monitor.failed_in_a_row == 3 and watch.monitor.last_decided_step == 4
    assert not any(k.startswith("flashwatch/") and "alerts" not in k for k in t.callback_metrics)


def test_port_in_use_fails_at_fit_start_and_leaves_the_model_untouched(loader, tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        watch = FlashWatchCallback(port=holder.getsockname()[1], console=None, run_dir=tmp_path)
        module = LitGPT()
        with pytest.raises(PortInUseError, match="already in use"):
            trainer([watch]).fit(module, loader)
    finally:
        holder.close()
    assert module.batches == 0 and watch.monitor.global_step == 0
    assert watch.monitor.layers == []  # detached
    assert torch.nn.functional.scaled_dot_product_attention.__module__ == "torch._C._nn"


def test_stop_on_stops_the_run_gracefully_and_run_dir_defaults_under_the_root_dir(loader, tmp_path):
    watch = FlashWatchCallback(port=None, console=None, max_logit_bound=-1e3, stop_on={"max_logit"})
    t = trainer([watch], default_root_dir=tmp_path)
    t.fit(LitGPT(), loader)
    assert t.global_step == 1 and watch.stopped is not None
    assert {a.rule for a in watch.stopped.alerts} == {"max_logit"}
    (record,) = read_jsonl(tmp_path / "flashwatch")
    assert record["step"] == 0 and {a["rule"] for a in record["new_alerts"]} == {"max_logit"}


def test_bad_arguments():
    from flashwatch import MonitorConfig

    with pytest.raises(ValueError, match="either config=MonitorConfig.*not both.*interval"):
        FlashWatchCallback(MonitorConfig(), interval=5)
    with pytest.raises(ValueError, match="no field 'intervall' \\(did you mean 'interval'\\?\\).*fields of MonitorConfig"):
        FlashWatchCallback(intervall=5)
    with pytest.raises(ValueError, match=r"MonitorConfig.interval must be an int >= 1"):
        FlashWatchCallback(interval=0)
    with pytest.raises(ValueError, match=r"port must be an int in 0\.\.65535"):
        FlashWatchCallback(port=70000)
    with pytest.raises(ValueError, match="console must be one of auto, live, print, log or None"):
        FlashWatchCallback(console="fancy")
    with pytest.raises(ValueError, match=r"run_dir must be a folder path \(str or os.PathLike\) or None, got 123"):
        FlashWatchCallback(run_dir=123)
    with pytest.raises(ValueError, match=r"log_summaries must be True or False, got 'no'"):
        FlashWatchCallback(log_summaries="no")


def test_the_callback_is_a_callback_of_both_lightning_packages():
    """A Trainer accepts only callbacks of its own package: the callback subclasses both
    (tests/test_lightning_namespaces.py trains with each)."""
    lightning = pytest.importorskip("lightning.pytorch")
    watch = FlashWatchCallback(port=None, jsonl=False, console=None)
    assert isinstance(watch, Callback) and isinstance(watch, lightning.Callback)


def test_a_run_dir_that_holds_a_run_is_refused_unless_appending(loader, tmp_path):
    config = dict(interval=2, port=None, console=None)
    trainer([FlashWatchCallback(run_dir=tmp_path, **config)], max_epochs=1).fit(LitGPT(), loader)
    before = (tmp_path / METRICS_FILE).read_bytes()
    module = LitGPT()
    with pytest.raises(FileExistsError, match=r"metrics\.jsonl already holds a run.*append=True"):
        trainer([FlashWatchCallback(run_dir=tmp_path, **config)], max_epochs=1).fit(module, loader)
    assert module.batches == 0 and (tmp_path / METRICS_FILE).read_bytes() == before  # nothing mixed in
    trainer([FlashWatchCallback(run_dir=tmp_path, append=True, **config)], max_epochs=1).fit(LitGPT(), loader)
    assert [r["kind"] for r in read_jsonl(tmp_path, kinds=None)].count("open") == 2  # asked for: appended
    with pytest.raises(ValueError, match="append must be True or False"):
        FlashWatchCallback(append="yes")


def test_a_rank_is_told_when_another_could_not_create_its_exporters(tmp_path):
    """Under several ranks only rank 0 makes the exporters (a run_dir that holds a run, a port in use
    fail there alone); the ranks decide together, so a rank whose own exporters were fine raises too
    instead of going on into attach() and waiting there for rank 0 (before: it waited until the
    process group's timeout). A stand-in trainer: rank 1 of 2, told that another rank failed."""
    class Strategy:
        def reduce_boolean_decision(self, decision, all=True):
            assert decision is True and all
            return False  # another rank's decision was False

    class Rank1:
        world_size, is_global_zero, strategy, ckpt_path, global_step = 2, False, Strategy(), None, 0

    watch = FlashWatchCallback(run_dir=tmp_path, port=None, console=None)
    with pytest.raises(RuntimeError, match="another rank could not create its exporters"):
        watch.on_fit_start(Rank1(), LitGPT())
    assert watch.monitor.layers == []


def test_a_loss_scaled_run_reads_true_units_and_skipped_steps_as_not_measured(loader, tmp_path):
    """The trainer's GradScaler (Lightning's 16-mixed precision plugin, here on the CPU) goes to the
    Monitor: with a first scale that overflows the gradients, the skipped step is not measured
    instead of raising non_finite; the measured steps are in true units: at the first step the
    delta error equals that of the same step without a scaler (the same weights and batch; FP16
    gradients that underflow without the scale leave a small difference)."""
    from pytorch_lightning.plugins.precision import MixedPrecision

    def fit(scaler, name, epochs=1):
        watch = FlashWatchCallback(interval=1, port=None, console=None, run_dir=tmp_path / name)
        trainer([watch], max_epochs=epochs, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]).fit(
            LitGPT(), loader)
        deltas = [[float(v) for layer in r["metrics"]["flashwatch_delta_error"] for v in layer]
                  for r in read_jsonl(tmp_path / name)]
        return watch, torch.tensor(deltas, dtype=torch.float64)

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 17)  # these FP16 gradients overflow at 2^17, not at 2^16
    watch, deltas = fit(scaler, "skipping", epochs=2)
    unmeasured = deltas.isnan().all(dim=1)
    assert (deltas.isnan() == unmeasured[:, None]).all()  # a step is measured in full or not at all
    assert unmeasured.sum() == 1 == round(math.log2(2.0 ** 17 / scaler.get_scale()))
    assert watch.monitor.alert_counts["non_finite"] == 0

    _, plain = fit(None, "plain")  # on the CPU Lightning's 16-mixed has no scaler: true units
    _, scaled = fit(torch.amp.GradScaler("cpu", init_scale=2.0 ** 16), "scaled")
    torch.testing.assert_close(scaled[0], plain[0], rtol=1e-3, atol=0)


def test_a_callback_used_again_for_a_new_run_starts_afresh(loader, tmp_path):
    """One callback for two runs (a sweep: a new module and Trainer each time, no ckpt_path): the second
    run gets its own Monitor, counted from step 0 with its own alerts, in its own folder; with the first
    run's run_dir it is refused, as any new run is. Fail before: the second run was appended to the
    first's metrics.jsonl as steps 6-11, the first run's alerts still active."""
    config = dict(interval=1, port=None, console=None, max_logit_bound=0.0)
    watch = FlashWatchCallback(**config)
    trainer([watch], max_epochs=1, default_root_dir=tmp_path / "a").fit(LitGPT(), loader)
    first = watch.monitor
    trainer([watch], max_epochs=1, default_root_dir=tmp_path / "b").fit(LitGPT(lr=1e-3), loader)
    assert watch.monitor is not first and first.global_step == watch.monitor.global_step == 6
    assert [r["step"] for r in read_jsonl(tmp_path / "a" / "flashwatch")] == list(range(6))
    assert [r["step"] for r in read_jsonl(tmp_path / "b" / "flashwatch")] == list(range(6))
    assert {a.step for a in watch.monitor.alerts if a.rule == "max_logit"} == {0}  # its own, from its first step

    fixed = FlashWatchCallback(run_dir=tmp_path / "fixed", **config)
    trainer([fixed], max_epochs=1).fit(LitGPT(), loader)
    module = LitGPT()
    with pytest.raises(FileExistsError, match="already holds a run"):
        trainer([fixed], max_epochs=1).fit(module, loader)
    assert module.batches == 0


def test_the_same_trainer_fitting_on_continues_the_run(loader, tmp_path):
    """A second fit of the same Trainer with a larger max_epochs goes on from its step count: the
    callback continues its run (same Monitor, same file), as before."""
    watch = FlashWatchCallback(interval=1, port=None, console=None, run_dir=tmp_path, append=True)
    module, t = LitGPT(), trainer([watch], max_epochs=1)
    t.fit(module, loader)
    first = watch.monitor
    t.fit_loop.max_epochs = 2
    t.fit(module, loader)
    assert watch.monitor is first and watch.monitor.global_step == t.global_step == 12


def test_a_resumed_run_writes_on_in_its_own_default_folder(loader, tmp_path):
    """Without run_dir the folder is under the logger's version folder, which a resumed fit changes
    (version_0 -> version_1): the resumed run writes on into the folder its checkpoint names, so one
    metrics.jsonl holds the run. Fail before: its steps went to version_1/flashwatch."""
    from pytorch_lightning.loggers import CSVLogger

    config = dict(interval=2, port=None, console=None)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)
    first = FlashWatchCallback(**config)
    trainer([first, ckpt], max_epochs=1, enable_checkpointing=True, logger=CSVLogger(tmp_path)).fit(LitGPT(), loader)
    resumed = FlashWatchCallback(**config)
    trainer([resumed], max_epochs=2, logger=CSVLogger(tmp_path)).fit(
        LitGPT(), loader, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    run = tmp_path / "lightning_logs" / "version_0" / "flashwatch"
    assert [r["step"] for r in read_jsonl(run)] == list(range(0, 12, 2))
    assert not (tmp_path / "lightning_logs" / "version_1" / "flashwatch").exists()


class TwoOptimizers(LitGPT):
    """Manual optimization stepping two optimizers a batch (as a GAN's): Lightning counts two steps."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        first, second = self.optimizers()
        _, loss = self.model(x, y)
        self.manual_backward(loss)
        first.step()
        first.zero_grad()
        second.step()
        second.zero_grad()
        self.batches += 1
        return loss.detach()

    def configure_optimizers(self):
        params = list(self.parameters())
        return torch.optim.AdamW(params[:4], lr=self.lr), torch.optim.AdamW(params[4:], lr=self.lr)


def test_a_batch_stepping_two_optimizers_is_labelled_as_lightning_counts(loader, tmp_path):
    """The Monitor's step labels are trainer.global_step's: after 6 batches of 2 optimizer steps, 12;
    a batch is measured when its first step is a monitored one (interval 4: steps 0, 4, 8). Fail
    before: the Monitor counted 6, and the resume check's warning fired on every resume."""
    watch = FlashWatchCallback(interval=4, port=None, console=None, run_dir=tmp_path)
    t = trainer([watch], max_epochs=1)
    t.fit(TwoOptimizers(), loader)
    assert t.global_step == watch.monitor.global_step == 12
    assert [r["step"] for r in read_jsonl(tmp_path)] == [0, 4, 8]


class Mixer(torch.nn.Module):
    """Attention with its own names (wq, wk, wv; no head count attribute): not found by itself."""

    def __init__(self, c=32, heads=2):
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv = (torch.nn.Linear(c, c, bias=False) for _ in range(3))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = (w(x).view(b, n, self.heads, c // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, n, c)


class LitMixer(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mixer = torch.nn.Embedding(256, 32), Mixer()

    def training_step(self, batch, batch_idx):
        return self.mixer(self.embed(batch[0])).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_model_that_is_not_found_by_itself_is_named_with_attention(loader, tmp_path):
    """The attach error tells the user to name the layers with attention=...: the callback takes it
    and measures the layer. Fail before: FlashWatchCallback(attention=...) was refused as an unknown
    MonitorConfig field, so a Lightning user had no way to watch such a model."""
    with pytest.raises(ValueError, match="attention="):
        trainer([FlashWatchCallback(interval=1, port=None, console=None, run_dir=tmp_path / "a")],
                max_epochs=1).fit(LitMixer(), loader)
    watch = FlashWatchCallback(interval=1, port=None, console=None, run_dir=tmp_path / "b",
                               attention={"mixer": lambda m: m.wq.weight.view(2, 16, 32)})
    trainer([watch], max_epochs=1).fit(LitMixer(), loader)
    opened = next(read_jsonl(tmp_path / "b", kinds=("open",)))
    assert [layer["name"] for layer in opened["layout"]] == ["mixer"]
    assert watch.monitor.snapshot()["flashwatch_attention_coverage"] == {(0,): 1.0}
    with pytest.raises(ValueError, match="attention must be None or a dict"):
        FlashWatchCallback(attention=["mixer"])


def test_the_lightning_example_runs_and_a_taken_port_is_an_error_message(tmp_path, capsys):
    """examples/lightning_example.py, briefly: it trains, writes its run folder and prints its summary;
    given a port in use it says so and returns 2 (before: a traceback)."""
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "lightning_example.py"
    main = runpy.run_path(str(path))["main"]
    n = torch.get_num_threads()
    try:
        assert main(["--epochs", "1", "--batches", "4", "--interval", "2", "--port", "0",
                     "--out", str(tmp_path / "run")]) == 0
        assert "4 optimizer steps" in capsys.readouterr().out
        assert [r["step"] for r in read_jsonl(tmp_path / "run" / "flashwatch")] == [0, 2]
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            assert main(["--epochs", "1", "--batches", "2", "--port", str(port), "--out", str(tmp_path / "b")]) == 2
        assert "already in use" in capsys.readouterr().err
    finally:
        torch.set_num_threads(n)
