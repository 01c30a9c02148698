"""The callback with both Lightning packages, ``lightning.pytorch`` and ``pytorch_lightning``;
its summaries in ``trainer.callback_metrics``, so EarlyStopping can monitor them.

Fail before: a ``lightning.pytorch`` Trainer rejected the callback (it subclassed
``pytorch_lightning``'s Callback only), and ``trainer.callback_metrics`` held no flashwatch value
(EarlyStopping(monitor="flashwatch/max_logit") raised: metric not available).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from flashwatch.lightning import FlashWatchCallback
from flashwatch.tinygpt import GPT, GPTConfig

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def _namespace(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        pytest.skip(f"{name} is not installed")


def _fit(ns, callbacks, max_epochs: int = 1):
    class LitGPT(ns.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model(x, y)[1]

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (12, 16), generator=g)
    loader = DataLoader(TensorDataset(x, x), batch_size=4)  # 3 batches per epoch
    trainer = ns.Trainer(accelerator="cpu", devices=1, max_epochs=max_epochs, callbacks=callbacks, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LitGPT(), loader)
    return trainer


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_trainer_of_either_package_runs_the_callback(namespace):
    ns = _namespace(namespace)
    watch = FlashWatchCallback(interval=1, port=None, jsonl=False, console=None)
    # a Callback of every Lightning package installed, not only of the one training here
    for other in NAMESPACES:
        try:
            other_ns = importlib.import_module(other)
        except ImportError:
            continue
        assert isinstance(watch, other_ns.Callback), other
    trainer = _fit(ns, [watch])
    assert watch.monitor.global_step == 3 and watch.monitor.monitored_steps == 3
    metrics = trainer.callback_metrics
    assert isinstance(metrics["flashwatch/max_logit"], torch.Tensor)
    assert float(metrics["flashwatch/max_logit"]) == pytest.approx(
        max(watch.monitor.snapshot()["flashwatch_max_logit"].values()))


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_early_stopping_monitors_a_flashwatch_value(namespace):
    ns = _namespace(namespace)
    watch = FlashWatchCallback(interval=1, port=None, jsonl=False, console=None)
    # stops once the max logit is below a threshold it is always below: after the first epoch
    stop = ns.callbacks.EarlyStopping(monitor="flashwatch/max_logit", mode="min", stopping_threshold=1e6,
                                      check_on_train_epoch_end=True)
    trainer = _fit(ns, [watch, stop], max_epochs=5)
    assert trainer.current_epoch == 1 and stop.stopped_epoch == 0
    assert watch.monitor.global_step == 3


@pytest.mark.parametrize("bound, epochs", [(1e6, 3), (1e-9, 1)])
def test_early_stopping_as_the_guide_writes_it_stops_only_past_the_bound(bound, epochs):
    """The GUIDE's guard: divergence_threshold with patience off stops once the max logit is past
    the bound, and never for a run below it (stopping_threshold would stop a healthy run)."""
    ns = _namespace("pytorch_lightning")
    watch = FlashWatchCallback(interval=1, port=None, jsonl=False, console=None)
    stop = ns.callbacks.EarlyStopping(monitor="flashwatch/max_logit", mode="min", divergence_threshold=bound,
                                      patience=10**9, check_on_train_epoch_end=True)
    trainer = _fit(ns, [watch, stop], max_epochs=3)
    assert trainer.current_epoch == epochs


def test_the_monitor_kernels_and_exporters_import_no_lightning(tmp_path):
    """Lightning is an extra: every flashwatch module but the callback (flashwatch.lightning) and
    the demo that trains with it (flashwatch.demo) imports neither package. Catches: a Lightning
    import in any core module (e.g. flashwatch/exporters/jsonl.py, exporters/prometheus.py)."""
    import os
    import subprocess
    import sys

    import flashwatch

    # the flashwatch under test, last on the path (the checkout's kernels/ must not shadow a package)
    root = os.path.dirname(os.path.dirname(os.path.abspath(flashwatch.__file__)))
    # packages are walked by hand: pkgutil.walk_packages would import the excluded ones to recurse
    code = ("import importlib, pkgutil, sys\n"
            f"sys.path.append({root!r})\n"
            "LIGHTNING = ('lightning', 'pytorch_lightning')\n"
            "EXCLUDED = ('flashwatch.lightning', 'flashwatch.demo')\n"
            "imported, skipped = [], []\n"
            "def walk(package):\n"
            "    for info in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
            "        name = info.name\n"
            "        if name in EXCLUDED:\n"
            "            continue\n"
            "        try:\n"
            "            module = importlib.import_module(name)\n"
            "        except ImportError as e:  # an optional extra missing: not Lightning\n"
            "            assert (e.name or '').split('.')[0] not in LIGHTNING, (name, e)\n"
            "            skipped.append((name, repr(e)))\n"
            "            continue\n"
            "        imported.append(name)\n"
            "        if info.ispkg:\n"
            "            walk(module)\n"
            "import flashwatch\n"
            "from flashwatch import Monitor, MonitorConfig\n"
            "walk(flashwatch)\n"
            "# flashwatch.kernels lives in the checkout's kernels/ (pyproject's package-dir): an editable\n"
            "# install maps it without a folder inside flashwatch/, so the walk above may not list it\n"
            "if 'flashwatch.kernels' not in imported:\n"
            "    imported.append('flashwatch.kernels')\n"
            "    walk(importlib.import_module('flashwatch.kernels'))\n"
            "need = {'flashwatch.monitor', 'flashwatch.kernels', 'flashwatch.exporters.jsonl',\n"
            "        'flashwatch.exporters.prometheus', 'flashwatch.exporters.console'}\n"
            "assert need <= set(imported), (sorted(need - set(imported)), skipped)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in LIGHTNING)\n"
            "assert not bad, bad[:5]\n"
            "print(len(imported), 'modules imported; skipped:', skipped)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
