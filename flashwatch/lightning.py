"""FlashWatchCallback: flashwatch's Monitor in a PyTorch Lightning ``Trainer``.

A thin adapter: every decision lives in ``flashwatch.Monitor``; this module only calls it at
the right Lightning hooks and wires up the exporters. It works with both Lightning packages,
``lightning`` (``lightning.pytorch``) and ``pytorch_lightning``: the callback is a Callback of
every one installed, so a Trainer from either accepts it (``pip install ".[lightning]"`` from a
flashwatch checkout installs ``pytorch-lightning``). Nothing else in flashwatch imports Lightning.

Multi-process strategies (DDP, ``ddp_spawn``, ``FSDPStrategy``, ``ModelParallelStrategy`` with
FSDP2 and/or tensor parallelism; docs/DISTRIBUTED.md): every rank runs the callback and its
Monitor; the Monitor combines the ranks' statistics, loss and gradient norm on monitored steps
over the process group Lightning initialized, so every rank decides and switches identically.
Under the sharded strategies the W^Q norms come from the shards (``flashwatch.sharded``). Rank 0 exports (Prometheus, JSONL, console, trainer loggers) and logs
alerts; ``per_rank_endpoints=True`` gives every rank its own ``/metrics`` endpoint.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any, Mapping, Sequence

import torch

from .config import MonitorConfig
from .exporters.base import Exporter
from .exporters.summary import scalar_summary
from .monitor import Monitor, TrainingStopped
from .vocabulary import check_port

log = logging.getLogger("flashwatch")

__all__ = ["FlashWatchCallback"]


def _callback_bases() -> tuple[type, ...]:
    """The ``Callback`` class of every Lightning package installed (a Trainer accepts only its own)."""
    bases = []
    try:
        from lightning.pytorch.callbacks import Callback as LightningCallback

        bases.append(LightningCallback)
    except ImportError:
        pass
    try:
        from pytorch_lightning.callbacks import Callback as PLCallback

        if PLCallback not in bases:
            bases.append(PLCallback)
    except ImportError:
        pass
    if not bases:
        raise ImportError("flashwatch.lightning needs Lightning: pip install pytorch-lightning (or lightning; from a "
                          "flashwatch checkout: pip install '.[lightning]'); the Monitor itself needs neither")
    return tuple(bases)


_CallbackBases = _callback_bases()

_CONSOLE_MODES = ("auto", "live", "print", "log")


class FlashWatchCallback(*_CallbackBases):  # type: ignore[misc]
    """Monitor a Lightning training run for BF16 flash-attention instability.

    Attaches a :class:`flashwatch.Monitor` to the LightningModule at fit start, feeds it once
    per optimizer step (loss, gradient norm before clipping), serves its metrics to Prometheus,
    writes them to a JSONL file, shows them on the console, logs scalar summaries through the
    trainer's loggers, and saves its state in checkpoints so that ``ckpt_path=`` resumes
    exactly.

    Hooks used:

    - ``on_fit_start``: attach the Monitor to ``pl_module`` (after ``configure_model`` and the
      move to the device), open the exporters. A new run (the trainer at step 0 without
      ``ckpt_path``) after this callback watched another gets a fresh Monitor (``callback.monitor``).
    - ``on_before_optimizer_step``: on monitored steps only, the global L2 norm of the
      gradients as a device tensor (no host sync), before Lightning clips them.
    - ``on_train_batch_end``: on monitored steps, add up the micro-batch losses (device
      tensors); once per optimizer step (``trainer.global_step`` advanced, so correct under
      ``accumulate_grad_batches``; a batch that stepped two optimizers is one measured step the
      Monitor counts as two, so its labels are the trainer's), ``monitor.step(loss=..., grad_norm=...)``, after the
      optimizer step, which is when W^Q is read; with a loss scaler (``precision="16-mixed"``
      on a GPU) the trainer's GradScaler goes with it, so the delta error is in true units and
      a step the scaler skipped is not measured rather than non-finite. Then, once a monitored
      step is decided, its scalar summaries go to every trainer logger under its step number.
    - ``on_fit_end``, ``on_exception``, ``teardown``: close the exporters (the HTTP server too)
      and detach the Monitor.

    Args:
        config: a :class:`flashwatch.MonitorConfig`; or leave it None and pass its fields as
            keywords (``interval=10, auto_fix="fp32_delta"``), not both.
        port: Prometheus ``/metrics`` port (default 9400, the port of ``dashboards/prometheus.yml``);
            ``0`` picks a free port (read it from ``callback.port``); ``None`` serves nothing.
        host: address the server binds; ``127.0.0.1`` so nothing outside the machine reads it
            unless you ask (``"0.0.0.0"``).
        run_dir: folder of ``metrics.jsonl`` and ``alerts.log``; default
            ``<trainer.log_dir or default_root_dir>/flashwatch``.
        jsonl: write the JSONL and alert log (default True).
        append: add this run to a ``run_dir`` that already holds one; by default such a folder
            is refused at fit start (``FileExistsError``), so two runs never mix in one
            ``metrics.jsonl``. A run resumed with ``trainer.fit(..., ckpt_path=...)`` appends
            to its own folder either way (with the default ``run_dir``, the folder its checkpoint
            names, not the resumed logger's new one).
        console: ``"auto"`` (a live panel on a terminal without a progress bar, a printed panel
            every 30 s beside one, plain log lines without a terminal), ``"live"``, ``"print"``,
            ``"log"``, or None for no console output.
        exporters: further exporters (``flashwatch.exporters.Exporter``) to feed (on global
            rank 0).
        log_summaries: log the scalar summaries below through the trainer's loggers.
        attention: for a model whose attention layers are not found by themselves, what
            ``Monitor.attach`` takes: ``{module_name: query_weight_fn}``, where
            ``query_weight_fn(module)`` returns that layer's W^Q as (heads, head_dim, model_dim);
            the names are those of the LightningModule's ``named_modules()``.
        per_rank_endpoints: under a multi-process strategy, serve ``/metrics`` on every rank,
            on ``port + local rank`` (``port=0``: a free port each), each series labelled
            ``rank="<global rank>"``; default False: one endpoint, on global rank 0, without a
            ``rank`` label. JSONL, console and logger output stay on rank 0 either way.
        **config_fields: fields of ``MonitorConfig`` when ``config`` is None.

    Raises:
        ValueError: a bad argument or config field (the message names it), or both ``config``
            and config fields given.
        flashwatch.exporters.PortInUseError: at fit start, when ``host:port`` is taken; the
            run stops before its first step.
        OSError: at fit start, when ``run_dir`` cannot be written; ``FileExistsError`` when it
            holds a run already and neither ``append=True`` nor ``ckpt_path=`` says to add to it.

    Alerts never raise: they are logged once each (``flashwatch`` logger), exported, and
    counted. Rules listed in ``MonitorConfig.stop_on`` stop the run gracefully through
    ``trainer.should_stop`` (as ``EarlyStopping`` does); the alerts are in ``callback.stopped``.

    Example::

        from lightning.pytorch import Trainer    # or: from pytorch_lightning import Trainer
        from flashwatch.lightning import FlashWatchCallback

        watch = FlashWatchCallback(interval=10, port=9400, auto_fix="fp32_delta")
        trainer = Trainer(precision="bf16-mixed", callbacks=[watch])
        trainer.fit(model, datamodule)          # http://127.0.0.1:9400/metrics while it runs
        print(watch.monitor.alerts)

    Logged metrics (through ``trainer.loggers`` once per monitored step, at the Monitor's
    ``interval`` rather than ``log_every_n_steps``, under that step's number, as Lightning labels
    the batch's own metrics; the finite ones are also in ``trainer.callback_metrics`` after every
    monitored step, as 0-d tensors, so ``EarlyStopping(monitor="flashwatch/max_logit")`` and
    ``ModelCheckpoint`` can use them). A monitored step where monitoring failed
    (``monitor.failed_in_a_row`` > 0; the log says why) is logged with its measured values as NaN
    and they leave ``callback_metrics``, never shown with an older step's values:

    - ``flashwatch/max_abs_drift_z``: largest |drift z| over all heads (dimensionless, a z-score).
    - ``flashwatch/max_repeated_max_ratio``: largest repeated-max row fraction, FP32 scores (fraction, 0-1).
    - ``flashwatch/max_repeated_max_ratio_bf16``: the same on BF16-rounded scores (fraction, 0-1).
    - ``flashwatch/max_wq_spectral_norm``: largest W^Q spectral norm over heads (weight units).
    - ``flashwatch/max_logit``: largest scaled attention score (natural-log units).
    - ``flashwatch/grad_norm``: global gradient L2 norm before clipping (gradient units).
    - ``flashwatch/alerts_total``: alerts raised so far, all rules (count).
    - ``flashwatch/alerts_active``: alerts holding now (count).
    """

    def __init__(
        self,
        config: MonitorConfig | None = None,
        *,
        port: int | None = 9400,
        host: str = "127.0.0.1",
        run_dir: str | os.PathLike | None = None,
        jsonl: bool = True,
        append: bool = False,
        console: str | None = "auto",
        exporters: Sequence[Exporter] = (),
        log_summaries: bool = True,
        per_rank_endpoints: bool = False,
        attention: Mapping[str, Any] | None = None,
        **config_fields: Any,
    ):
        if config is not None and config_fields:
            raise ValueError(
                f"pass either config=MonitorConfig(...) or its fields as keywords, not both "
                f"(got config and {', '.join(sorted(config_fields))})")
        if config is None:
            try:
                config = MonitorConfig(**config_fields)
            except TypeError as exc:  # an unknown keyword
                raise ValueError(f"FlashWatchCallback: {exc}; accepted keywords: port, host, run_dir, "
                                 f"jsonl, append, console, exporters, log_summaries, per_rank_endpoints, attention "
                                 f"and the fields of MonitorConfig") from None
        elif not isinstance(config, MonitorConfig):
            raise ValueError(f"config must be a flashwatch.MonitorConfig or None, got {type(config).__name__}")
        check_port(port)
        if not isinstance(host, str) or not host:
            raise ValueError(f"host must be an address such as '127.0.0.1', got {host!r}")
        if console is not None and console not in _CONSOLE_MODES:
            raise ValueError(f"console must be one of {', '.join(_CONSOLE_MODES)} or None, got {console!r}")
        if not isinstance(jsonl, bool):
            raise ValueError(f"jsonl must be True or False, got {jsonl!r}")
        if not isinstance(append, bool):
            raise ValueError(f"append must be True or False, got {append!r}")
        if not isinstance(log_summaries, bool):
            raise ValueError(f"log_summaries must be True or False, got {log_summaries!r}")
        if run_dir is not None and (not isinstance(run_dir, (str, os.PathLike)) or not os.fspath(run_dir)):
            raise ValueError(f"run_dir must be a folder path (str or os.PathLike) or None, got {run_dir!r}")
        if not isinstance(per_rank_endpoints, bool):
            raise ValueError(f"per_rank_endpoints must be True or False, got {per_rank_endpoints!r}")
        if attention is not None and not isinstance(attention, Mapping):
            raise ValueError(f"attention must be None or a dict {{module_name: query_weight_fn}}, got "
                             f"{type(attention).__name__}")
        if isinstance(exporters, (str, bytes, os.PathLike)) or callable(getattr(exporters, "export", None)):
            raise ValueError(f"exporters must be a list of flashwatch.exporters.Exporter instances (the callback "
                             f"writes run_dir itself), got {exporters!r}: pass exporters=[...] or run_dir=")
        for e in exporters:
            if not all(callable(getattr(e, m, None)) for m in ("open", "export", "close")):
                raise ValueError(f"exporters must be flashwatch.exporters.Exporter instances, got {type(e).__name__}")
        self.config = config
        self.port_requested = port
        self.host = host
        self.run_dir = None if run_dir is None else os.fspath(run_dir)
        self.jsonl = jsonl
        self.append = append
        self.console = console
        self.extra_exporters = list(exporters)
        self.log_summaries = log_summaries
        self.per_rank_endpoints = per_rank_endpoints
        self.attention = dict(attention) if attention is not None else None

        self.monitor = Monitor(config)  # picks up Lightning's process group at attach
        self.prometheus = None  # the PrometheusExporter (rank 0, or every rank per_rank_endpoints); serves while fitting
        self.stopped: TrainingStopped | None = None
        self._exporters_added = False
        self._seen_global_step: int | None = None
        # (monitored step, whether monitoring was failing) last put into callback_metrics
        self._published_step: tuple[int, bool] | None = None
        self._logged_step: tuple[int, bool] | None = None  # (monitored step, failed) last sent to the loggers
        self._loss_sum: torch.Tensor | float | None = None
        self._loss_batches = 0
        self._grad_norm: torch.Tensor | None = None
        self._plain_grads_replicated = False  # set per fit from the strategy (see _setup_distributed)
        self._jsonl_dir: str | None = None  # the folder metrics.jsonl goes to (rank 0), kept in checkpoints
        self._resumed_jsonl_dir: str | None = None  # that folder as a checkpoint recorded it

    # -- identity and state -------------------------------------------------------------------

    @property
    def state_key(self) -> str:
        # one key whatever the settings: a run resumed with another interval or mode continues
        # from its state (the Monitor says what changed), instead of Lightning dropping it
        return type(self).__qualname__

    @property
    def port(self) -> int | None:
        """The port the Prometheus server listens on while fitting (None otherwise)."""
        return None if self.prometheus is None else self.prometheus.port

    @property
    def url(self) -> str | None:
        """``http://host:port/metrics`` while fitting (None otherwise)."""
        return None if self.prometheus is None else self.prometheus.url

    def state_dict(self) -> dict[str, Any]:
        state = {"monitor": self.monitor.state_dict()}
        if self._jsonl_dir is not None:
            state["run_dir"] = self._jsonl_dir  # a resume writes on there (the default folder moves with log_dir)
        return state

    def on_load_checkpoint(self, trainer: "Trainer", pl_module: "LightningModule", checkpoint: dict) -> None:
        # a checkpoint from a flashwatch whose key named the interval and mode
        # ("FlashWatchCallback{'interval': 10, 'mode': 'observe'}"): its state, where this key has none
        saved = checkpoint.get("callbacks") or {}
        older = [k for k in saved if isinstance(k, str) and k.startswith(self.state_key + "{")]
        if self.state_key not in saved and len(older) == 1:
            self.load_state_dict(saved[older[0]])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start for most strategies: the Monitor
        # keeps the state and applies it when it attaches.
        self.monitor.load_state_dict(state_dict["monitor"])
        self._resumed_jsonl_dir = state_dict.get("run_dir")
        if self._jsonl_dir is not None and self._resumed_jsonl_dir not in (None, self._jsonl_dir):
            # restored after fit start (strategies that restore after setup): the folder was chosen already
            log.warning("flashwatch: this resumed run writes to %s; its steps before the checkpoint are in %s (pass "
                        "run_dir= to keep a run in one folder)", self._jsonl_dir, self._resumed_jsonl_dir)

    # -- fit start / end ----------------------------------------------------------------------

    def on_fit_start(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        if trainer.ckpt_path is None and trainer.global_step == 0 and self.monitor.global_step > 0:
            self._start_new_run()
        if not self._exporters_added:
            # Created once: a later fit re-opens the same exporters (same port, same JSONL).
            # Only rank 0 exports: other ranks would fight over the port and the files
            # (per_rank_endpoints: every rank serves its own port).
            failure, exporters = None, []
            try:
                if trainer.is_global_zero:
                    exporters = self._make_exporters(trainer)
                elif self.per_rank_endpoints and self.port_requested is not None:
                    exporters = [self._make_prometheus(trainer)]
            except Exception as exc:
                failure = exc
            # every rank stops alike (a run folder that holds a run, a port in use: rank 0's alone),
            # so that no rank goes on into attach() and waits there for one that raised
            if trainer.world_size > 1 and not trainer.strategy.reduce_boolean_decision(failure is None, all=True) \
                    and failure is None:
                raise RuntimeError("flashwatch: another rank could not create its exporters (its error says why: a "
                                   "run_dir that holds a run, a port in use); every rank stops")
            if failure is not None:
                raise failure
            for e in exporters:
                self.monitor.add_exporter(e)  # not attached yet: attach() opens them
            self._exporters_added = True
        self._setup_distributed(trainer)
        self.stopped = None
        try:
            self.monitor.attach(pl_module, self.attention)
        except BaseException:
            self._finish()
            raise

    def _start_new_run(self) -> None:
        """This callback watched a run before, and a trainer starts another from step 0 (not resumed):
        a fresh Monitor and fresh exporters, so that the two runs' steps, alerts and files never mix
        (a ``run_dir`` that holds the earlier run is then refused, as for any new run)."""
        log.info("flashwatch: a new run (the trainer starts at step 0, without ckpt_path, after this callback "
                 "watched %d steps): its Monitor and exporters start afresh", self.monitor.global_step)
        self.monitor = Monitor(self.config)
        self.prometheus = None
        self._exporters_added = False
        self._jsonl_dir = self._resumed_jsonl_dir = None

    def on_train_start(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        # After restore_training_state: global_step is the resumed one.
        self._seen_global_step = trainer.global_step
        self._published_step = None  # Lightning empties callback_metrics when a fit starts
        self._logged_step = None
        self._reset_step()
        if self.monitor.global_step != trainer.global_step and trainer.is_global_zero:
            log.warning("flashwatch: the Monitor has counted %d optimizer steps, the trainer %d (a resumed run "
                        "without flashwatch state in its checkpoint?); flashwatch's step label follows its own "
                        "count", self.monitor.global_step, trainer.global_step)

    def on_fit_end(self, trainer: "Trainer", pl_module: "LightningModule") -> None:
        self._finish()

    def on_exception(self, trainer: "Trainer", pl_module: "LightningModule", exception: BaseException) -> None:
        self._finish()

    def teardown(self, trainer: "Trainer", pl_module: "LightningModule", stage: str) -> None:
        if stage == "fit":
            self._finish()

    def _finish(self) -> None:
        """Close exporters (the HTTP server too) and detach. Idempotent; never raises."""
        self.monitor.close()
        try:
            self.monitor.detach()
        except Exception:  # never let cleanup hide the run's own error
            log.warning("flashwatch: detach failed", exc_info=True)

    def _setup_distributed(self, trainer: "Trainer") -> None:
        """Tell the Monitor what the strategy knows: sharded weights (FSDP) and their gradient norms."""
        # DDP: every rank's gradients are the all-reduced ones, so each rank's norm is the global
        # norm; a sharded strategy leaves each rank its shard's gradients: sqrt(sum of squares)
        self.monitor.set_sharding(_strategy_sharding(trainer.strategy))
        # ModelParallelStrategy: the sharded gradients are DTensors, a plain one is a replicated
        # parameter's; FSDPStrategy's (FSDP1) plain gradients are this rank's shard
        self._plain_grads_replicated = type(trainer.strategy).__name__ == "ModelParallelStrategy"
        if trainer.world_size > 1:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()) and trainer.is_global_zero:
                log.warning("flashwatch: %d processes but torch.distributed is not initialized (strategy %s): each "
                            "rank's Monitor sees only its own statistics", trainer.world_size,
                            type(trainer.strategy).__name__)

    def _make_prometheus(self, trainer: "Trainer") -> Exporter:
        from .exporters.prometheus import PrometheusExporter

        if self.per_rank_endpoints and trainer.world_size > 1:
            port = self.port_requested + trainer.local_rank if self.port_requested else self.port_requested
            check_port(port, f"per_rank_endpoints: port {self.port_requested} + local rank {trainer.local_rank}",
                       allow_none=False)
            self.prometheus = PrometheusExporter(port=port, host=self.host,
                                                 const_labels={"rank": str(trainer.global_rank)})
        else:
            self.prometheus = PrometheusExporter(port=self.port_requested, host=self.host)
        return self.prometheus

    def _make_exporters(self, trainer: "Trainer") -> list[Exporter]:
        from .exporters.console import ConsoleExporter
        from .exporters.jsonl import JsonlExporter

        out: list[Exporter] = []
        if self.port_requested is not None:
            out.append(self._make_prometheus(trainer))
        if self.jsonl:
            run_dir = self.run_dir
            if run_dir is None:
                run_dir = os.path.join(trainer.log_dir or trainer.default_root_dir, "flashwatch")
                resumed = self._resumed_jsonl_dir if trainer.ckpt_path is not None else None
                if resumed is not None and os.path.isdir(resumed):
                    run_dir = resumed  # a resumed run goes on in its folder, not in the new log_dir's
                elif resumed is not None:
                    log.warning("flashwatch: the checkpoint's run folder %s is not here; this resumed run writes to "
                                "%s", resumed, run_dir)
            exporter = JsonlExporter(run_dir)
            self._jsonl_dir = os.path.abspath(run_dir)
            if not self.append and trainer.ckpt_path is None and exporter.holds_run():
                raise FileExistsError(
                    f"flashwatch: {exporter.path} already holds a run; pass another run_dir, or append=True "
                    f"to add this run to it (a run resumed with trainer.fit(..., ckpt_path=...) appends by itself)")
            out.append(exporter)
        if self.console is not None:
            mode = self.console
            if mode == "auto":
                from rich.console import Console

                terminal = Console(stderr=True).is_terminal
                # A progress bar redraws the terminal too: print the panel beside it instead.
                mode = ("print" if trainer.progress_bar_callback is not None else "live") if terminal else "log"
            out.append(ConsoleExporter(mode))
        return out + self.extra_exporters

    # -- the step -----------------------------------------------------------------------------

    def _reset_step(self) -> None:
        self._loss_sum, self._loss_batches, self._grad_norm = None, 0, None

    def on_before_optimizer_step(self, trainer: "Trainer", pl_module: "LightningModule",
                                 optimizer: torch.optim.Optimizer) -> None:
        # Called after the (unscaled) gradients are final and before Lightning clips them.
        if not self.monitor.monitoring or self._grad_norm is not None:
            return
        # Under a sharded model the ranks' norms are combined as sqrt(sum of squares): each rank
        # counts a gradient once per copy of it in the group (``_copies``), so that a piece every rank
        # holds (a replicated parameter beside tensor-parallel ones) adds up to its norm once.
        sharded, world = self.monitor.sharding is not None, max(self.monitor.world_size, 1)
        groups: dict[float, list[torch.Tensor]] = {}
        for p in pl_module.parameters():
            if p.grad is not None:
                g = _local(p.grad.detach())
                if g.numel():  # FSDP: parameters outside this rank's shard have empty views
                    groups.setdefault(_copies(p.grad, world, self._plain_grads_replicated) if sharded else 1.0,
                                      []).append(g)
        if groups:
            # One fused norm kernel per device and dtype (as clip_grad_norm_) and group of copies, then
            # the L2 norm in FP32 (no host value: the result stays on the device until the one transfer)
            squares = []
            for copies, grads in groups.items():
                norms = torch._foreach_norm(grads, 2)
                device = norms[0].device
                squares.append(torch.stack([n.to(device, torch.float32) for n in norms]).square().sum() / copies)
            self._grad_norm = torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt()

    def on_train_batch_end(self, trainer: "Trainer", pl_module: "LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.monitor.monitoring:
            loss = _loss_of(outputs)
            if loss is not None:
                # Automatic optimization divides each micro-batch loss by accumulate_grad_batches;
                # the sum over the micro-batches is the step's mean loss (device add, no sync).
                self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
                self._loss_batches += 1
        if self._seen_global_step is None:
            self._seen_global_step = trainer.global_step
        if trainer.global_step == self._seen_global_step:
            return  # accumulating: no optimizer step in this batch
        stepped = trainer.global_step - self._seen_global_step
        self._seen_global_step = trainer.global_step
        loss = self._step_loss(trainer, pl_module)
        grad_norm = self._grad_norm
        self._reset_step()
        try:
            self.monitor.step(loss=loss, grad_norm=grad_norm, grad_scaler=_grad_scaler(trainer))
        except TrainingStopped as exc:
            self.stopped = exc
            trainer.should_stop = True  # every rank: the alert was decided on the same data everywhere
            if trainer.is_global_zero:
                log.error("%s; stopping the run (MonitorConfig.stop_on)", exc)
        # a batch that stepped several optimizers (manual optimization): the batch's statistics are its first
        # step's; the Monitor counts the others too, so that its step labels are the trainer's
        for _ in range(stepped - 1):
            self.monitor._advance()
        self._publish(trainer)
        if self.log_summaries:
            self._log_summaries(trainer)

    def _summaries(self) -> dict[str, float] | None:
        """``flashwatch/<name>`` -> value of the last monitored step; None before one. While the
        latest monitored steps failed (``Monitor.failed_in_a_row``), the measured values are NaN
        (not measured): an older step's values are never shown as this step's."""
        snap = self.monitor.snapshot()
        if math.isnan(snap.get("flashwatch_step", math.nan)):
            return None
        summary = scalar_summary(snap, measured=not self.monitor.failed_in_a_row)
        return {f"flashwatch/{k}": v for k, v in summary.items()}

    def _publish(self, trainer: "Trainer") -> None:
        """The finite summaries into ``trainer.callback_metrics`` (what EarlyStopping and
        ModelCheckpoint read); a value not measured (NaN) is left out, never shown as a number."""
        decided = self.monitor.last_decided_step
        state = (decided, self.monitor.failed_in_a_row > 0)
        if decided is None or state == self._published_step:
            return  # nothing new since the last publication: no per-step host work
        callback_metrics = getattr(trainer, "callback_metrics", None)
        metrics = self._summaries()
        if metrics is None or not isinstance(callback_metrics, dict):
            return
        self._published_step = state
        for name, value in metrics.items():
            if math.isfinite(value):
                callback_metrics[name] = torch.tensor(float(value))
            else:
                callback_metrics.pop(name, None)

    def _step_loss(self, trainer: "Trainer", pl_module: "LightningModule") -> Any:
        if self._loss_sum is None:
            return None
        if pl_module.automatic_optimization:
            n = max(1, int(trainer.accumulate_grad_batches))
            if self._loss_batches != n:  # a short accumulation window at the end of an epoch
                return self._loss_sum * (n / self._loss_batches)
            return self._loss_sum
        return self._loss_sum / self._loss_batches

    def _log_summaries(self, trainer: "Trainer") -> None:
        """Each monitored step's summaries to the trainer's loggers once, under that step's number
        (the optimizer step, as Lightning labels the batch's own metrics); a monitored step that
        failed is logged as not measured (NaN) under its own number."""
        if not trainer.loggers:
            return
        failing = self.monitor.failed_in_a_row > 0
        step = self.monitor.last_failed_step if failing else self.monitor.last_decided_step
        if step is None or (step, failing) == self._logged_step:
            return  # nothing new since the last one logged: no per-step host work
        metrics = self._summaries()
        if metrics is None:
            return  # no monitored step decided yet
        self._logged_step = (step, failing)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _strategy_sharding(strategy: Any) -> str | None:
    """Why a Lightning strategy leaves no rank the whole weights between steps, or None."""
    name = type(strategy).__name__
    if "FSDP" in name:
        return f"Lightning's {name} shards the weights"
    if name == "ModelParallelStrategy":
        return "Lightning's ModelParallelStrategy shards the weights (FSDP2 / tensor parallelism)"
    if name.startswith("DeepSpeed") and getattr(strategy, "zero_stage_3", False):
        return "DeepSpeed ZeRO-3 partitions the weights"
    return None


def _copies(grad: torch.Tensor, world: int, plain_replicated: bool) -> float:
    """How many ranks of the Monitor's group (``world`` ranks) hold this gradient piece: a DTensor's
    replicated mesh dimensions times the ranks outside its mesh; a plain tensor: every rank where
    plain gradients are replicated (beside FSDP2 or tensor-parallel DTensors), else one (FSDP1's
    flat-parameter shards are plain tensors)."""
    placements, mesh = getattr(grad, "placements", None), getattr(grad, "device_mesh", None)
    if placements is None or mesh is None:
        return float(world) if plain_replicated else 1.0
    copies = 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return float(copies * max(world // mesh.size(), 1))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 gradients), any other tensor as it is."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _grad_scaler(trainer: "Trainer") -> Any:
    """The trainer's loss scaler (``precision="16-mixed"``'s GradScaler), or None. Lightning calls
    ``scaler.update()`` inside its optimizer step, before ``on_train_batch_end``, as
    ``Monitor.step`` wants it."""
    scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
    return scaler if isinstance(scaler, torch.amp.GradScaler) else None


def _loss_of(outputs: Any) -> torch.Tensor | None:
    """The loss in ``training_step``'s output (a tensor, or a dict's ``"loss"``), detached."""
    if isinstance(outputs, dict):
        outputs = outputs.get("loss")
    if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
        return outputs.detach().reshape(())
    return None
