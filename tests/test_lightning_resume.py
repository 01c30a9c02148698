"""Lightning ``ckpt_path=`` resume at an epoch boundary: every per-head value of every monitored step
equals the uninterrupted run's, including the W^Q spectral norms and their power-iteration state.

Variants beyond tests/test_lightning.py's: the checkpoint of ``ModelCheckpoint(every_n_epochs=1)``
(no ``last.ckpt``), an interval that does not divide the epoch (the first monitored step after the
resume is not the first step of the epoch), two power iterations per step with an exact restart
every other monitored step, BF16 autocast and gradient clipping.
"""

from __future__ import annotations

import pytest
from pytorch_lightning.callbacks import ModelCheckpoint
from test_lightning import LitGPT, assert_same, loader, trainer  # noqa: F401  (loader: a fixture)

from flashwatch.exporters.jsonl import read_jsonl
from flashwatch.lightning import FlashWatchCallback

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("config, fit", [
    (dict(interval=5), {}),
    (dict(interval=2, power_iters=2, power_exact_every=2), dict(precision="bf16-mixed", gradient_clip_val=0.5)),
], ids=["interval5", "exact_every_bf16_clip"])
def test_resume_at_epoch_boundary_equals_uninterrupted_run(loader, tmp_path, config, fit):  # noqa: F811
    config = dict(port=None, console=None, warmup=2, **config)
    whole = FlashWatchCallback(run_dir=tmp_path / "whole", **config)
    trainer([whole], max_epochs=4, **fit).fit(LitGPT(), loader)

    first = FlashWatchCallback(run_dir=tmp_path / "parts", **config)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    trainer([first, ckpt], max_epochs=2, enable_checkpointing=True, **fit).fit(LitGPT(), loader)
    path = sorted((tmp_path / "ckpt").glob("epoch=1-*.ckpt"))[0]
    resumed = FlashWatchCallback(run_dir=tmp_path / "parts", **config)
    trainer([resumed], max_epochs=4, **fit).fit(LitGPT(), loader, ckpt_path=str(path))

    assert resumed.monitor.global_step == whole.monitor.global_step == 24
    whole_steps = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "whole")}
    parts_steps = {r["step"]: r["metrics"] for r in read_jsonl(tmp_path / "parts")}
    assert sorted(parts_steps) == sorted(whole_steps) == list(range(0, 24, config["interval"]))
    for step, metrics in whole_steps.items():
        per_head = [k for k, v in metrics.items() if isinstance(v, list) and k != "flashwatch_kernel_variant"]
        assert "flashwatch_wq_spectral_norm" in per_head
        for name in per_head:
            assert parts_steps[step][name] == metrics[name], (step, name)
    assert_same(whole.monitor.state_dict(), resumed.monitor.state_dict())
    assert whole.monitor.wq_spectral_norms() == resumed.monitor.wq_spectral_norms()


def test_a_checkpoint_saved_after_fit_resumes_like_one_saved_during_it(loader, tmp_path):  # noqa: F811
    """``trainer.save_checkpoint`` after ``fit()`` (the callback has detached by then) holds the
    Monitor's layers as training left them: a new Trainer resumes from it and ends where the
    uninterrupted run does."""
    config = dict(port=None, console=None, warmup=2, interval=3)
    whole = FlashWatchCallback(run_dir=tmp_path / "whole", **config)
    trainer([whole], max_epochs=4).fit(LitGPT(), loader)

    first = FlashWatchCallback(run_dir=tmp_path / "parts", **config)
    ended = trainer([first], max_epochs=2)
    ended.fit(LitGPT(), loader)
    ended.save_checkpoint(tmp_path / "after-fit.ckpt")
    resumed = FlashWatchCallback(run_dir=tmp_path / "parts", **config)
    trainer([resumed], max_epochs=4).fit(LitGPT(), loader, ckpt_path=str(tmp_path / "after-fit.ckpt"))

    assert resumed.monitor.global_step == whole.monitor.global_step == 24
    assert_same(whole.monitor.state_dict(), resumed.monitor.state_dict())
    assert whole.monitor.wq_spectral_norms() == resumed.monitor.wq_spectral_norms()


def test_a_run_resumed_with_another_interval_and_variant_keeps_its_state(loader, tmp_path):  # noqa: F811
    """Resumed with interval 4 and own-kernel ``fp32_delta`` (the remedy the alerts suggest) from a
    run at interval 3 in observe mode: the Monitor continues from the checkpoint's state (its step
    count, its records in the same run folder) and every layer runs what the new run asks. Fail
    before: the callback's state key named the interval and mode, so Lightning dropped the state
    (steps labelled from 0 again), and a loaded state put back the saved run's kernels. A checkpoint
    whose key still names them (an earlier flashwatch) is read too."""
    import torch

    first = FlashWatchCallback(run_dir=tmp_path / "run", port=None, console=None, interval=3)
    ended = trainer([first], max_epochs=2)
    ended.fit(LitGPT(), loader)
    ended.save_checkpoint(tmp_path / "a.ckpt")
    assert first.monitor.global_step == 12
    checkpoint = torch.load(tmp_path / "a.ckpt", weights_only=False)
    checkpoint["callbacks"] = {"FlashWatchCallback{'interval': 3, 'mode': 'observe'}": v
                               for v in checkpoint["callbacks"].values()}
    torch.save(checkpoint, tmp_path / "older.ckpt")
    for name in ("a", "older"):
        resumed = FlashWatchCallback(run_dir=tmp_path / name, port=None, console=None, interval=4,
                                     mode="own_kernel", variant="fp32_delta")
        trainer([resumed], max_epochs=4).fit(LitGPT(), loader, ckpt_path=str(tmp_path / f"{name}.ckpt"))
        assert resumed.monitor.global_step == 24, name
        ran = {(layer["mode"], layer["variant"]) for layer in resumed.monitor.state_dict()["layers"]}
        assert ran == {("own_kernel", "fp32_delta")}, (name, ran)
        assert [r["step"] for r in read_jsonl(tmp_path / name)] == [12, 16, 20], name
