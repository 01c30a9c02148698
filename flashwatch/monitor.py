"""Monitor: the framework-neutral core (schedule, decisions, actions, state).

A plain PyTorch loop and the Lightning callback both drive one ``Monitor``: ``attach(model)``
once, ``step(loss=..., grad_norm=...)`` once per optimizer step after ``optimizer.step()``.
The contract is docs/INTERFACES.md.

Cost model. Step t is monitored iff ``t % config.interval == 0``; the flag for step t is set at
the end of step t-1 (at attach for step 0), so the attention wrappers read one Python bool.
On unmonitored steps ``step()`` only counts. On a monitored step everything stays on the
device until one host transfer (``flashwatch.collect``): every layer's statistics and W^Q-error
readings, the W^Q power-iteration results and the loss / gradient norm (if given as device
tensors). The host half (``flashwatch.step_signals``, the detectors, the actions, the exports)
runs on host data only.

Distributed data parallel (docs/DISTRIBUTED.md): when ``torch.distributed`` is initialized
with more than one process (Lightning's DDP strategy does that; a plain DDP script calls
``init_process_group``), ``attach`` picks up the default process group (``process_group=``
chooses another, or None for none) and every monitored step combines the ranks' readings in one
packed all-reduce (``flashwatch.distributed``) before the host transfer, so every rank decides
and acts identically. Every rank must then call ``step()`` once per optimizer step, as every
rank calls DDP's backward. Alerts, clearings and switches are logged by rank 0 only; failures
by the rank that has them.

Logged as "flashwatch" (Python ``logging``): each alert once when it starts (warning, or error
when critical), its clearing (info), each auto-fix switch (warning), and the first failure of
each kind inside monitoring (warning with traceback; later ones are counted in ``errors``, and
monitored steps that keep failing are logged again at 10, 100, ... in a row).

Example::

    monitor = Monitor(MonitorConfig(interval=10, auto_fix="fp32_delta"))
    monitor.attach(model)
    for step in range(steps):
        loss = model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step(); opt.zero_grad()
        for alert in monitor.step(loss=loss.detach(), grad_norm=grad_norm):
            print(alert.message)
    monitor.close()
"""

from __future__ import annotations

import logging
import math
import numbers
import time
import weakref
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .attach import AttentionLayer, find_attention, is_compiled_wrapper, select_layers, wrapped
from .chain import FIELDS as CHAIN_FIELDS
from .chain import Chains
from .collect import FIELDS, Collector, Pending
from .config import MonitorConfig
from .decisions import Decisions
from .detectors import Alert
from .distributed import AUTO, Reducer, resolve_process_group, sharding_of, structural_attention
from .exporters.base import Exporter, FanOut, Layout, StepRecord
from .families import query_norm
from .kernels import STAT_FIELDS, AttentionStats
from .loss_scale import LossScale, check_grad_scaler, unscale_statistics, why_unreadable
from .routing import CHECKPOINT_FLAG, Router, checkpoint_fallbacks, clear_routing_state
from .snapshot import extra_signals, host_record, snapshot
from .step_signals import LayerReading, SignalBuilder
from .vocabulary import MODES, VARIANT_CODE, VARIANT_LABELS
from .wq import WqNorms

log = logging.getLogger("flashwatch")

__all__ = ["Monitor", "TrainingStopped"]

STATE_VERSION = 2  # 1: before the W^Q-error chain (still loaded)
# the parts every saved state has (``Monitor.state_dict()``; ``Decisions.state_dict()``'s among them)
STATE_KEYS = ("layers", "global_step", "monitored_steps", "errors", "last", "detectors", "alerts", "alert_counts",
              "ever_active", "switches")
# after the first failure (logged with its traceback) a run of failed monitored steps is logged again
# when it reaches each of these lengths: monitoring that stays broken is never only a counter
FAILED_STEPS_REPORTED = frozenset(10 ** k for k in range(1, 7))


class TrainingStopped(RuntimeError):
    """Raised by ``Monitor.step`` when an alert of a rule in ``MonitorConfig.stop_on`` starts.

    The step is complete when it is raised (statistics read, alerts logged and exported,
    ``global_step`` advanced), so a checkpoint taken in an ``except`` block resumes cleanly.

    Attributes:
        alerts: the alerts that caused the stop.
        step: the optimizer step at which they started.
    """

    def __init__(self, alerts: Sequence[Alert], step: int):
        self.alerts = list(alerts)
        self.step = step
        rules = ", ".join(sorted({a.rule for a in alerts}))
        super().__init__(f"flashwatch stopped training at step {step} on {rules}: " +
                         "; ".join(a.message for a in alerts[:3]) + (" ..." if len(alerts) > 3 else ""))


def _uncompiled(model: nn.Module) -> nn.Module:
    """The model ``torch.compile`` wrapped, where ``model`` is its wrapper (the same modules, so the
    same hooks; the layers are named as in the model itself, ``attach.named_modules``)."""
    while is_compiled_wrapper(model):
        model = wrapped(model)
    return model


class Monitor:
    """Watches a model's attention during training and raises early warnings.

    Args:
        config: a ``MonitorConfig`` (None: defaults).
        exporters: ``flashwatch.exporters.Exporter`` instances; opened at ``attach``, given a
            ``StepRecord`` at every monitored step, closed by ``close()``. Under DDP pass them
            on the rank that should export (usually rank 0): the Monitor exports wherever it has
            exporters.
        process_group: whose statistics to combine, resolved at ``attach``: ``"auto"`` (the
            default ``torch.distributed`` group when it is initialized with more than one
            process, else nothing), None (this process alone), or a process group. With a
            group, every member must call ``step()`` once per optimizer step.

    Attributes:
        config: the configuration.
        layers: the attached ``AttentionLayer`` list (list index == ``layer`` label).
        alerts, alert_counts, switches, detectors, active_alerts: the decisions so far
            (``flashwatch.decisions``).
        global_step: optimizer steps seen by ``step()``.
        errors: failures inside monitoring (each kind logged once, failed steps in a row again at 10,
            100, ...); training never stops for them.
        rank, world_size: this process's rank in the group the statistics are combined over,
            and its size (0 and 1 without one), as of ``attach``.
        sharding: why the model counts as sharded (FSDP, FSDP2, tensor parallelism, ...), or None.

    Raises:
        TypeError: config is not a MonitorConfig.
        flashwatch.TrainingStopped: from ``step()``, for rules in ``config.stop_on``.
    """

    def __init__(self, config: MonitorConfig | None = None, exporters: Sequence[Exporter] = (), *,
                 process_group: Any = AUTO, **unknown: Any):
        if unknown:
            settings = ", ".join(f"{k}={v!r}" for k, v in unknown.items())
            raise TypeError(f"Monitor got unexpected keyword(s) {', '.join(unknown)}; it takes config, exporters and "
                            f"process_group. Settings go in a MonitorConfig: Monitor(MonitorConfig({settings}))")
        if config is None:
            config = MonitorConfig()
        if not isinstance(config, MonitorConfig):
            raise TypeError(f"config must be a flashwatch.MonitorConfig or None, got {type(config).__name__}")
        if isinstance(process_group, str) and process_group != AUTO:
            raise ValueError(f"process_group must be 'auto', None or a torch.distributed process group, "
                             f"got {process_group!r}")
        self.config = config
        # a bound method, not a lambda: the Monitor pickles (Lightning's ddp_spawn sends the callback to its processes)
        self._fan = FanOut(exporters, on_error=self._on_export_error)
        self.process_group = process_group
        self.rank, self.world_size = 0, 1
        self._reducer: Reducer | None = None
        self.sharding: str | None = None
        self._declared_sharding: str | None = None  # set_sharding()
        self.layers: list[AttentionLayer] = []
        self._wq: WqNorms | None = None
        self._router: Router | None = None
        self._ever_attached = False  # step() before the first attach() is warned about
        self._closed = False  # close() ended the run: step() does nothing until attach() again
        self._held_runs: list[str] = []  # exporters whose output already held a run at attach (see step())
        self._unattached()
        self.global_step = 0
        self.monitored_steps = 0  # monitored steps processed so far (the detectors' warm-up clock)
        self._monitoring = True  # step 0 is monitored
        self._decisions = Decisions(config, self._error)
        self.errors = 0
        self._failed_in_a_row = 0  # monitored steps failed since the last one that worked
        self._last_failed_step: int | None = None
        self._loss_scale = LossScale(self._warn_once)  # step(grad_scaler=...): each monitored step's loss scale
        self._units_unknown_in_a_row = 0  # monitored steps whose gradients' loss scale was unknown (skipped)
        self._error_kinds: set[str] = set()
        self._warned: set = set()
        self._last = None  # the latest decided step as plain data (host_record), made when first read
        self._pending_state: dict | None = None  # from load_state_dict() before attach
        self._detached_state: dict | None = None  # from detach(): attaching the same layers again continues
        self._pending: Pending | None = None  # a monitored step whose host copy is on its way (CUDA)
        # decided by a flush between optimizer steps, acted on at the next step() as if decided there
        # (the auto_fix switches wait in Decisions.due_switches); all three are part of state_dict()
        self._due_alerts: list[Alert] = []  # returned by the next step() (a flush inside state_dict())
        self._stops_due: list[Alert] = []  # stop_on alerts: raised by the next step()

    # --- attach / detach --------------------------------------------------------------------------
    def set_sharding(self, sharding: str | None) -> None:
        """Declare that the model's weights are sharded across ranks (call before ``attach``).

        For an adapter that knows the strategy (the Lightning callback under FSDP); without it,
        ``attach`` recognises FSDP, FSDP2, tensor-parallel and DeepSpeed ZeRO-3 models itself.
        With a reason given, the layers are found by structure and each layer's W^Q is read
        where this rank holds it (``flashwatch.sharded``), and each rank's plain-tensor
        ``grad_norm`` is taken as the norm of its own shard: ranks combine them as sqrt(sum of
        squares) (a DTensor norm is already global). None: not declared.
        """
        if sharding is not None and not isinstance(sharding, str):
            raise TypeError(f"sharding must be a reason (str) or None, got {type(sharding).__name__}")
        if self._router is not None:
            raise RuntimeError("set_sharding() must come before attach()")
        self._declared_sharding = sharding

    def attach(self, model: nn.Module, attention: Mapping[str, Any] | None = None) -> list[AttentionLayer]:
        """Find the attention layers of ``model``, route their attention, open the exporters.

        Args:
            model: the model (nanoGPT-style, Hugging Face GPT-2 / Llama-style found
                automatically; see ``flashwatch.families``).
            attention: ``{module_name: query_weight_fn}`` for other models, where
                ``query_weight_fn(module)`` returns that layer's W^Q as (heads, head_dim, model_dim).

        Returns:
            the attached layers (also ``monitor.layers``).

        Under ``torch.distributed`` (see ``process_group``) this is where the group is picked
        up; every rank must attach the same model. A sharded model (FSDP, FSDP2, tensor
        parallelism, DeepSpeed ZeRO-3; ``flashwatch.distributed.sharding_of``) is attached by
        module structure; FSDP-sharded W^Q norms come from power iteration on the shards (its
        collectives run on every monitored step, in ``step()``, and in ``state_dict()`` under
        tensor parallelism: every rank calls them alike), tensor-parallel heads from the rank
        that holds them under their global indices; layouts not supported read NaN, with one
        warning saying why (``flashwatch.sharded``).

        Raises:
            RuntimeError: already attached (``detach()`` first).
            ValueError: no attention layer found, or ``config.layers`` selects nothing, or a
                ``process_group`` this process cannot use.
            Whatever an exporter's ``open`` raises (a port in use, ...): nothing stays attached.
        """
        if self._router is not None and self._closed:
            self.detach()  # closed: its routing is gone already; keep its state for the layers attached next
        if self._router is not None:
            raise RuntimeError("this Monitor is already attached to a model; call monitor.detach() first")
        given, model = model, _uncompiled(model)
        group = resolve_process_group(self.process_group)
        sharding = self._declared_sharding or sharding_of(model)
        if sharding is not None and attention is None:
            # a rank holds a shard of each weight between steps: find the layers without reading one
            attention = structural_attention(model)
            if not attention:
                raise ValueError(f"no attention layer found in the sharded model ({sharding}): name them with "
                                 "attach(model, attention={'blocks.0.attn': query_weight_fn, ...})")
        # found in the model as given: names of attention= through its wrapper (_orig_mod.) name its modules too
        found = select_layers(find_attention(given, attention), self.config.layers)
        own = self.config.mode == "own_kernel"
        layers = []
        for i, (name, module, heads, fn, family) in enumerate(found):
            layer = AttentionLayer(index=i, name=name, module=module, num_heads=heads, query_weight_fn=fn,
                                   family=family, mode=self.config.mode,
                                   variant=self.config.variant if own else "sdpa", format=self.config.format)
            w = layer.query_weight()
            layer.ensure_stats(w.device)
            shape = (layer.num_heads, *layer.placement.shape[1:]) if layer.placement is not None else tuple(w.shape)
            layer.chain = (Chains.make(family, shape, w.device, layer.placement_kind, head_offset=layer.head_offset,
                                       total_heads=layer.total_heads) if self.config.wq_error_chain else None)
            norm = query_norm(module)
            if layer.chain is not None and norm is not None:
                layer.chain = None
                log.warning("flashwatch: layer %d (%s): its query passes through %s (QK-norm) after the projection, "
                            "so the W^Q-gradient error metrics are not defined there and read NaN; every other "
                            "statistic is measured", i, name, norm)
            layers.append(layer)
        self.sharding = sharding
        wq = WqNorms(layers, self.config.power_block, model=model, on_error=self._error)
        chains = Chains(layers, self._error)
        chains.start(wq)
        if group is None:
            self._reducer, self.rank, self.world_size = None, 0, 1
        else:
            split = any(layer.num_heads != layer.total_heads for layer in layers)  # tensor parallel: own heads
            reducer = Reducer(*group, [layer.total_heads for layer in layers], n_fields=len(FIELDS),
                              max_rows=layers[0].stats.max_rows(), grad_norm="l2" if sharding else "max",
                              local=[(layer.head_offset, layer.num_heads) for layer in layers] if split else None,
                              names=[layer.name for layer in layers])
            self._reducer, self.rank, self.world_size = reducer, group[1], group[2]
        router = Router(layers, beta=self.config.beta, eps=self.config.eps, on_error=self._error, root=model)
        router.monitoring = self._monitoring
        router.on_taken_over = weakref.WeakMethod(self._taken_over)  # weakly: the router must not keep the Monitor
        self.layers, self._wq, self._chains, self._router = layers, wq, chains, router
        self._signals = SignalBuilder([layer.total_heads for layer in layers], self.config.window)
        self._collector = Collector(layers, self._reducer, self.config.async_transfer, self._error,
                                    self._check_combined)
        router.install()
        self._ever_attached = True
        self._closed = False
        self._held_runs = [str(getattr(e, "path", e.name)) for e in self._fan.exporters
                           if callable(getattr(e, "holds_run", None)) and e.holds_run()]
        pending, self._pending_state = self._pending_state, None
        resumed, self._detached_state = self._detached_state, None
        failure, open_before = None, self._fan.opened
        try:
            self._fan.open(Layout(layers=[(layer.name, layer.total_heads) for layer in layers],
                                  config=self.config.to_dict()))
            state = pending
            if state is None and resumed is not None and [(s["name"], s["num_heads"]) for s in resumed["layers"]] \
                    == [(layer.name, layer.total_heads) for layer in layers]:
                state = resumed  # the same layers again (e.g. a second fit): carry on where detach() left off
            if state is not None:
                due = self._due_alerts, self._stops_due  # a step() after detach() may have acted on them already
                self.load_state_dict(state)
                if state is resumed:
                    self._due_alerts, self._stops_due = due
        except BaseException as exc:
            failure = exc
        if self._reducer is not None:
            try:  # one small collective: the ranks' layouts and configs agree and every rank attached
                self._reducer.check_layout(config=self.config.to_dict(), failed=failure is not None,
                                           step=self.global_step)
            except BaseException as exc:
                failure = failure if failure is not None else exc
        if failure is not None:
            # nothing stays attached; no collective here (a rank that failed alone would wait in it):
            # the state this attach would have continued from is kept for the next one
            self._router.remove()
            self._router = None
            self._fan.close_opened_since(open_before)  # no server left bound, no file left open by this attach
            self._unattached()
            self._pending_state, self._detached_state = pending, resumed
            raise failure
        if self._reporting:
            self._log_attached(sharding)
        if self.rank != 0 and self._held_files() and "rank_exporters" not in self._warned:
            self._warned.add("rank_exporters")  # said by this rank itself: rank 0 does not know
            log.warning("flashwatch (rank %d): this rank has exporters that write files (%s), and every rank of the "
                        "group holds the same values: pass exporters on rank 0 only, or give each rank its own "
                        "run_dir, or the ranks write the same records into one file", self.rank,
                        ", ".join(self._held_files()))
        return self.layers

    def _held_files(self) -> list[str]:
        """The run folders or files this Monitor's exporters write."""
        return [str(e.path if getattr(e, "path", None) is not None else e.run_dir) for e in self._fan.exporters
                if getattr(e, "path", None) is not None or getattr(e, "run_dir", None) is not None]

    def _log_attached(self, sharding: str | None) -> None:
        log.info("flashwatch attached to %d attention layer%s (%s mode, interval %d): %s", len(self.layers),
                 "" if len(self.layers) == 1 else "s", self.config.mode, self.config.interval,
                 ", ".join(f"{l.index}={l.name}" for l in self.layers))
        if self._reducer is not None:
            chain = sum(c.flat_size for c in self._chains.chains)
            log.info("flashwatch: statistics, loss, gradient norm and W^Q norms are combined over %d ranks on "
                     "monitored steps (%s%s); every rank must call monitor.step() once per optimizer step",
                     self.world_size, self._reducer.describe(),
                     f"; before it, the W^Q-gradient error's accumulators: 1 all-reduce (SUM) of {chain} float64 "
                     f"({chain * 8 / 1024:.1f} KiB)" if chain else "")
        if sharding is not None:
            self._wq.log_placements(sharding)
        no_chain = [f"{l.index}={l.name} ({l.family})" for l in self.layers if l.chain is None]
        if not self.config.wq_error_chain:
            log.info("flashwatch: the W^Q-gradient error chain is off (MonitorConfig.wq_error_chain=False): the "
                     "flashwatch_wq_error_* metrics read NaN (not measured)")
        elif no_chain and sharding is None:
            log.info("flashwatch: the W^Q-error metrics (flashwatch_wq_error_*) are NaN for layers %s: they need a "
                     "query that is the projection's output of the module's input (nanoGPT-style, Hugging Face "
                     "GPT-2 or Llama-style attention; not explicitly named modules)", ", ".join(no_chain))
        rotary = [f"{l.index}={l.name}" for l in self.layers if l.chain is not None and l.rotary]
        if rotary:
            log.info("flashwatch: layers %s rotate their queries (RoPE): their W^Q-error metrics turn each row back "
                     "through the call's position_embeddings", ", ".join(rotary))

    def detach(self) -> None:
        """Remove every hook and restore ``torch.nn.functional.scaled_dot_product_attention``.

        The model is exactly as before ``attach``. History (alerts, counts, the last snapshot)
        stays readable; ``attach`` may be called again, and attaching layers of the same names
        and head counts continues every signal where it stopped (drift sums, power-iteration
        vectors, variants), as a resume from ``state_dict()`` would.
        """
        if self._router is not None:
            self._router.remove()
            self._detached_state = self.state_dict()  # flushes a monitored step in flight
        self._router = None
        self._unattached()

    def _taken_over(self) -> None:
        """Another Monitor attached this one's model (its router took the modules over): detached,
        as the warning said, so that this Monitor neither claims the model nor alerts on calls it
        can no longer see."""
        try:
            self.detach()
        except Exception as exc:  # never reaches the other Monitor's attach
            self._error("detach", exc)

    def _unattached(self) -> None:
        """No model: the loss and gradient norm are still tracked (no layer readings)."""
        self.layers, self._wq, self._reducer = [], None, None
        self._chains = Chains([], self._error)
        self._signals = SignalBuilder([], self.config.window)
        self._collector = Collector([], None, self.config.async_transfer, self._error, self._check_combined)

    def add_exporter(self, exporter: Exporter) -> None:
        """Add an exporter; opened at once if the Monitor is attached (its errors raise)."""
        self._fan.add(exporter)

    @property
    def _reporting(self) -> bool:
        """Whether this process logs alerts and decisions (rank 0 of the group, or a lone process)."""
        return self.rank == 0

    def close(self) -> None:
        """End the run: decide the last monitored step, export it, close every exporter, and give
        the model back (torch's SDPA restored, no hook left, as after ``detach()``).

        On CUDA with ``config.async_transfer`` the last monitored step's values are still on
        their way when training ends; ``close()`` waits for them, decides that step (its alerts
        are logged and exported like any other) and then closes the exporters, so the record of
        every monitored step is written. Without ``close()`` (or ``flush()``) that step is never
        decided: use the Monitor as a context manager (``with Monitor(...) as monitor:``) to
        close it on every exit. A ``stop_on`` alert of that step is logged, not raised. Never
        raises (failures are logged and counted in ``errors``); calling it again is harmless
        (an exporter's ``close`` is idempotent). After it, ``step()`` measures and writes nothing
        (it warns once); history stays readable, and ``attach()`` monitors again, continuing every
        signal where it stopped when the layers are the same (as after ``detach()``).
        """
        try:
            self._flush(for_next_step=False)
        except Exception as exc:
            self._error("flush", exc)
        try:
            self._fan.close()
        except Exception as exc:
            self._error("close", exc)
        try:
            if self._router is not None:
                self._router.remove()  # no collective here: detach() snapshots the state, close() need not
        except Exception as exc:
            self._error("close", exc)
        self._closed = True

    def __enter__(self) -> "Monitor":
        """``with Monitor(config) as monitor:`` closes the Monitor (``close()``) when the block ends."""
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        """``close()`` on every exit, an exception's included; the exception goes on (never masked)."""
        self.close()
        return False

    # --- schedule ----------------------------------------------------------------------------------
    @property
    def monitoring(self) -> bool:
        """Whether the current optimizer step (``global_step``) is monitored. No sync."""
        return self._monitoring

    @property
    def variants(self) -> dict[int, str]:
        """Layer index -> the variant it runs now (``"sdpa"`` for an observed layer)."""
        return {layer.index: layer.running_variant for layer in self.layers}

    @property
    def active_alerts(self) -> list[Alert]:
        """Alerts holding now, over all rules."""
        return self._decisions.active

    @property
    def detectors(self) -> list:
        """The rule objects (``flashwatch.detectors``), in ``RULES`` order."""
        return self._decisions.detectors

    @property
    def alerts(self) -> list[Alert]:
        """Every alert raised so far, in order."""
        return self._decisions.alerts

    @property
    def alert_counts(self) -> dict[str, int]:
        """Alerts raised per rule (every rule, zeros included)."""
        return self._decisions.alert_counts

    @property
    def switches(self) -> list[dict]:
        """Auto-fix switches: dicts with step, layer, name, from, to, rule."""
        return self._decisions.switches

    def step(self, loss: Any = None, grad_norm: Any = None, *, grad_scaler: Any = None) -> list[Alert]:
        """Close optimizer step ``global_step``; call once per optimizer step, after ``optimizer.step()``.

        Args:
            loss: the step's training loss, a float or a 0-d (or one-element) tensor or numpy
                array; read only on monitored steps, inside the single host transfer.
            grad_norm: the global gradient norm before clipping, likewise (None: not tracked).
            grad_scaler: FP16 training with a ``torch.amp.GradScaler``: the scaler, at every
                step, with ``step()`` called after ``scaler.update()``. The delta error and the
                W^Q-gradient error are then in true units (divided by the loss scale the step's
                backward used), and a step the scaler skipped (its gradients overflowed) reads them
                as not measured, and a non-finite ``grad_norm`` there too, instead of raising
                ``non_finite``; so does a step whose scale is not known (the first monitored step
                with this scaler or after a resume, where the update before it grew or cut the
                scale). Without it they are in scaled units. No host synchronisation.

        Returns:
            alerts that started at this step (empty on unmonitored steps).

        After ``close()`` it only counts the step (one warning) until ``attach()`` is called again.

        Raises:
            TypeError, ValueError: loss or grad_norm is not a number or one-element tensor;
                grad_scaler is not a GradScaler.
            TrainingStopped: an alert of a rule in ``config.stop_on`` started at this step.
        """
        loss = _check_scalar("loss", loss)
        grad_norm = _check_scalar("grad_norm", grad_norm)
        grad_scaler = check_grad_scaler(grad_scaler)
        why = why_unreadable(grad_scaler) if grad_scaler is not None else None
        if why is not None:
            self._warn_once("grad_scaler", "flashwatch: cannot read the loss scale: %s; the delta error and the W^Q-"
                            "gradient error are in scaled units, and a step the scaler skips raises non_finite", why)
            grad_scaler = None
        if self._closed:  # counted, so that step labels follow the optimizer if attach() comes again
            self._warn_once("closed", "flashwatch: Monitor.step() after close(): nothing is measured or written; "
                            "call monitor.attach(model) to monitor again")
            self._advance()
            return []
        if not self._ever_attached:
            self._warn_once("unattached", "flashwatch: Monitor.step() was called before attach(model): only the loss "
                            "and gradient norm are tracked until monitor.attach(model) is called")
        elif self._router is None:
            self._warn_once("detached", "flashwatch: Monitor.step() after detach(): no attention layer is measured, "
                            "only the loss and gradient norm are tracked, until monitor.attach(model) is called again")
        t = self.global_step
        if self._held_runs:  # known now whether this run was resumed (a state loaded after attach too)
            if t == 0 and self._reporting:
                log.warning("flashwatch: %s already held a run's records when this run started at step 0: this "
                            "run's records follow them in the same file, and a report of it shows both runs as "
                            "one; give each run its own run_dir (appending is for a run resumed from its state)",
                            ", ".join(self._held_runs))
            self._held_runs = []
        if self._router is not None:
            clear_routing_state()  # no forward runs between optimizer steps (one that raised left its layer pushed)
            for layer in self.layers:  # nor the projection input and rotation it took
                layer.chain_input = layer.chain_rotation = None
        ran = [layer.running_variant for layer in self.layers]  # what step t ran, before a decision below switches one
        # what a flush between the steps decided: acted on now, as if decided here
        new, self._due_alerts = self._due_alerts, []
        stops, self._stops_due = self._stops_due, []
        self._decisions.apply_due(self.layers)
        decided = self._drain()  # an earlier monitored step whose values were still on their way (CUDA)
        if self._monitoring:
            if self._router is not None:
                for layer in self.layers:  # compiled calls record their fallback without logging it
                    self._router.log_fallback(layer)
            if "checkpoint_fallback" not in self._warned and self._router is not None and checkpoint_fallbacks():
                self._warn_once("checkpoint_fallback", "flashwatch: torch.compile ran a frame of this model eagerly: "
                                "under activation checkpointing it does not compile code that changes outside state, "
                                "as flashwatch's layer hooks do (their state needs no replay in the recomputed "
                                "forward). Set %s = True to compile it; check that your own checkpointed code has no "
                                "side effect that must run again in the backward. It is measured either way.",
                                CHECKPOINT_FLAG)
            pending = None
            coverage = [tuple(layer.coverage.tolist()) for layer in self.layers]  # CPU counters: no sync
            try:
                pending = self._collect(t, loss, grad_norm, grad_scaler)
            except Exception as exc:  # monitoring never stops training
                self._error("step", exc)
                self._step_failed(t)
                self.monitored_steps += 1
            finally:
                self._reset_stats()
            if pending is not None:
                pending.variants = ran
                pending.coverage = coverage
                if pending.event is None:
                    decided.extend(self._decide_safely(pending))
                else:
                    self._pending = pending
        self._advance()
        if grad_scaler is not None and self._monitoring:
            try:
                self._loss_scale.remember(grad_scaler, self.global_step)  # the scale the next step's backward uses
            except Exception as exc:  # monitoring never stops training: the next step's scale is then inferred
                self._error("loss_scale", exc)
        new.extend(decided)
        stops.extend(a for a in decided if a.rule in self.config.stop_on)
        if stops:
            raise TrainingStopped(stops, stops[0].step)
        return new

    def _advance(self) -> None:
        """On to the next optimizer step: whether it is monitored, here and in the router."""
        self.global_step += 1
        self._monitoring = self.global_step % self.config.interval == 0
        if self._router is not None:
            self._router.monitoring = self._monitoring

    def flush(self) -> list[Alert]:
        """Decide a monitored step whose values are still on their way to the host.

        With ``config.async_transfer`` on CUDA, ``step()`` only starts the host copy of a
        monitored step and decides its alerts at the next ``step()`` call. ``state_dict()``,
        ``detach()`` and ``close()`` flush first, so nothing measured is lost; call it yourself
        before reading ``snapshot()`` or ``alerts`` right after a monitored step.

        A flush decides, logs and exports, but does not change what training does next: the
        step's actions happen at the next ``step()``, where they would have happened without
        it (an ``auto_fix`` switch applies from the optimizer step after that one; a
        ``stop_on`` alert raises ``TrainingStopped`` there).

        Returns:
            the alerts that started (not returned again by the next ``step()``).
        """
        return self._flush(for_next_step=False)

    def _flush(self, for_next_step: bool) -> list[Alert]:
        """Decide a step in flight, deferring its actions to the next ``step()``; with
        ``for_next_step`` the next ``step()`` also returns its alerts (a flush the caller did not ask
        for, as inside ``state_dict()``)."""
        new = self._drain(defer=True)
        self._stops_due.extend(a for a in new if a.rule in self.config.stop_on)
        if for_next_step:
            self._due_alerts.extend(new)
        return new

    def _drain(self, defer: bool = False) -> list[Alert]:
        pending, self._pending = self._pending, None
        return self._decide_safely(pending, defer) if pending is not None else []

    def _decide_safely(self, pending: Pending, defer: bool = False) -> list[Alert]:
        try:
            new = self._decide(pending, defer)
        except Exception as exc:  # monitoring never stops training
            self._error("step", exc)
            self._step_failed(pending.step)
            new = []
        else:
            self._failed_in_a_row = 0
        self.monitored_steps += 1
        return new

    def _note_units_unknown(self, step: int, unknown: bool) -> None:
        """Count monitored steps in a row whose gradients' loss scale was unknown (the loss scaler
        skipped them): the delta error is blind then, so a scaler that keeps skipping, as when every
        step's gradients overflow, is logged at 10, 100, ... in a row, never only a run of NaN."""
        self._units_unknown_in_a_row = self._units_unknown_in_a_row + 1 if unknown else 0
        if self._units_unknown_in_a_row in FAILED_STEPS_REPORTED and self._reporting:
            log.warning("flashwatch: the loss scaler skipped the last %d monitored steps (step %d the latest), so "
                        "their delta error and W^Q-gradient error are not measured: are the gradients overflowing "
                        "at every step?", self._units_unknown_in_a_row, step)

    def _step_failed(self, step: int) -> None:
        """Count a monitored step that failed in either half: ``failed_in_a_row`` says that what
        ``snapshot()`` holds is older than the latest monitored step, and the log repeats the count
        at 10, 100, ... failures in a row."""
        self._failed_in_a_row += 1
        self._last_failed_step = step
        if self._failed_in_a_row in FAILED_STEPS_REPORTED:
            log.warning("flashwatch%s: the last %d monitored steps all failed (step %d the latest): nothing is "
                        "measured and no alert can fire until this is fixed; the first failure's traceback was "
                        "logged above", self._rank_tag(), self._failed_in_a_row, step)

    # --- the monitored step: device half -----------------------------------------------------------
    def _collect(self, t: int, loss: Any, grad_norm: Any, grad_scaler: Any = None) -> Pending:
        """Every layer's readings, the W^Q norms, loss and gradient norm: packed, combined over
        ranks, their host copy started (``flashwatch.collect``); the gradient-unit readings divided
        by the step's loss scale when a ``grad_scaler`` is given (``flashwatch.loss_scale``)."""
        inverse_scale = None
        if grad_scaler is not None:
            try:
                inverse_scale = self._loss_scale.inverse_scale(grad_scaler, t)
            except Exception as exc:  # every rank must still reach the collective below: gradient units unknown
                self._error("loss_scale", exc)
                device = self.layers[0].stats.device if self.layers else None
                inverse_scale = torch.full((), math.nan, dtype=torch.float64, device=device)  # a fill: no copy

        def read() -> tuple[torch.Tensor, list[torch.Tensor]]:
            # the collectives in here (the chain's accumulators, FSDP's power iteration) run on every
            # rank whatever failed before them on this one: a failure is raised after them, so the
            # rank sends its "failed" vector to the step's collective as the others send theirs
            self._chains.average(self._reducer)
            failure, packed = None, None
            try:
                if inverse_scale is not None:
                    self._chains.unscale_(inverse_scale)
                # every layer at once: (len(STAT_FIELDS) + len(CHAIN_FIELDS), total heads), layers side by side
                if self.layers:
                    stats = AttentionStats.packed_all([layer.stats for layer in self.layers])
                    if inverse_scale is not None:
                        stats = unscale_statistics(stats, inverse_scale.to(stats.device))
                    chains = self._chains.readings(self.layers, self.config.window).to(stats.device)
                    packed = torch.cat([stats, chains])
                else:
                    packed = torch.zeros((len(FIELDS), 0), dtype=torch.float64)
            except Exception as exc:
                failure = exc
            every = self.config.power_exact_every
            exact = bool(every) and self.monitored_steps % every == every - 1
            sigmas = self._wq.step(exact, self.config.power_iters, self._error,
                                   pairs=bool(self._chains.chains)) if self._wq is not None else []
            self._chains.update_pairs(self._wq)
            if failure is not None:
                raise failure
            return packed, sigmas

        codes = [VARIANT_CODE[layer.variant] for layer in self.layers]
        units_unknown = inverse_scale.isnan() if inverse_scale is not None else None
        return self._collector.collect(t, read, loss, grad_norm, codes, units_unknown)

    def _check_combined(self, red: Any, t: int) -> bool:
        """Checks of a step combined over ranks; False: skip it (a rank could not measure it)."""
        if red.failed:
            self._warn_once(("dist", "failed"), "flashwatch: %d of %d ranks could not measure monitored step %d; every "
                            "rank skips it (the failing rank logged why)", red.failed, self.world_size, t)
            return False
        if red.steps[0] != red.steps[1]:
            self._warn_once(("dist", "steps"), "flashwatch: the ranks are at different steps (%d to %d) at a monitored "
                            "step: every rank must call monitor.step() once per optimizer step", *red.steps)
        for layer, hi, lo in zip(self.layers, red.variants, red.variants_min):
            if hi != lo:  # cannot happen while every rank decides on the same data; repaired if it does
                target = VARIANT_LABELS[hi]
                if self._reporting or layer.variant != target:
                    log.error("flashwatch%s: layer %d (%s) ran different variants on different ranks (%s to %s); "
                              "every rank runs %s from step %d on", self._rank_tag(), layer.index, layer.name,
                              VARIANT_LABELS[lo], target, target, self.global_step + 1)
                layer.mode, layer.variant = ("observe", "sdpa") if hi == 0 else ("own_kernel", target)
        spread = Reducer.sigma_spread(red)
        if self.sharding is None and spread > 1e-6:
            self._warn_once(("dist", "sigma"), "flashwatch: W^Q spectral norms differ between ranks by up to %.2g "
                            "(relative) at step %d: the replicas' weights are not identical (DDP keeps them so); "
                            "the detectors use the largest", spread, t)
        return True

    def _reset_stats(self) -> None:
        AttentionStats.reset_all([layer.stats for layer in self.layers if layer.stats is not None])
        if self.layers:
            torch._foreach_zero_([layer.coverage for layer in self.layers])

    # --- the monitored step: host half -------------------------------------------------------------
    def _decide(self, pending: Pending, defer: bool = False) -> list[Alert]:
        """Signals, detectors, alerts, actions and exports of monitored step ``pending.step``
        (``defer``: the auto_fix switches wait for the next ``step()``)."""
        got = pending.readings()
        if got is None:
            return []
        grad_norm, grad_norm_given = got.grad_norm, got.grad_norm_given
        if grad_norm_given and math.isfinite(grad_norm) and grad_norm < 0:
            # a norm is never negative: a bug in the caller's value, not a reading; NaN (not
            # measured) rather than a value that looks like one, and training goes on
            self._warn_once("negative_grad_norm", "flashwatch: grad_norm=%r at step %d is negative, so it is not a norm "
                            "(pass the total gradient norm, e.g. what clip_grad_norm_ returns); such values are "
                            "ignored and the gradient norm is reported as not measured (NaN)", grad_norm, pending.step)
            grad_norm, grad_norm_given = math.nan, False
        if got.grad_units_unknown and grad_norm_given and not math.isfinite(grad_norm):
            grad_norm, grad_norm_given = math.nan, False  # the overflow the loss scaler skipped the step for
        t = pending.step
        ran = pending.variants or [layer.running_variant for layer in self.layers]
        coverage = getattr(pending, "coverage", None) or [None] * len(self.layers)
        readings = []
        per_layer = got.per_layer([layer.total_heads for layer in self.layers])
        for layer, variant, calls, (fields, sigma) in zip(self.layers, ran, coverage, per_layer):
            measured_rows = fields["rows"].sum() > 0
            if not measured_rows and not (calls and calls[0]):
                self._warn_unseen(t, layer)  # no call at all; calls seen but not measured: attention_coverage
            if calls is not None and not calls[0] and measured_rows:
                calls = None  # rows measured, yet no call counted here (another rank's calls): coverage unknown
            elif calls is not None and calls[1] and not measured_rows:
                calls = (calls[0], 0)  # its measured calls left every row out (all padding): none measured
            readings.append(LayerReading(stats={n: fields[n] for n in STAT_FIELDS},
                                         chain={n: fields[n] for n in CHAIN_FIELDS}, sigma=sigma,
                                         low_precision=layer.low_precision, variant=variant, calls=calls))
            layer.calls = 0
        signals = self._signals.build(step=t, index=self.monitored_steps, loss=got.loss, grad_norm=grad_norm,
                                      readings=readings, loss_given=got.loss_given, grad_norm_given=grad_norm_given,
                                      grad_units_unknown=got.grad_units_unknown)
        self._note_units_unknown(t, got.grad_units_unknown)
        new = self._decisions.judge(t, signals, self._wq.unmeasured if self._wq else set(), self._reporting)
        self._last = None
        self._last_signals = signals  # host_record(signals) when first read (_last): most steps nobody reads it
        self._decisions.auto_fix(t, self.global_step + 1, self.layers, new, self._reporting, defer=defer)
        if self._fan.exporters:  # the snapshot is made for them (snapshot() makes it again on request)
            self._fan.export(StepRecord(step=t, time=time.time(), snapshot=self.snapshot(), new_alerts=list(new),
                                        active_alerts=self.active_alerts))
        return new

    @property
    def _last(self) -> dict | None:
        """The latest decided monitored step as plain data (``host_record``), None before the first."""
        if self._last_signals is not None:
            self._last_record, self._last_signals = host_record(self._last_signals), None
        return self._last_record

    @_last.setter
    def _last(self, record: dict | None) -> None:
        self._last_record, self._last_signals = record, None

    def _warn_unseen(self, t: int, layer: AttentionLayer) -> None:
        self._warn_once((layer.index, "no_call"),
                        "flashwatch: layer %d (%s) saw no measured attention call during monitored step %d: does the "
                        "model call torch.nn.functional.scaled_dot_product_attention (Hugging Face: "
                        "attn_implementation='sdpa') with gradients enabled, and is monitor.step() called once per "
                        "optimizer step (after its backward)?", layer.index, layer.name, t)

    # --- errors ------------------------------------------------------------------------------------
    def _on_export_error(self, exporter: Exporter, phase: str, exc: BaseException) -> None:
        self.errors += 1

    def _error(self, kind: str, exc: BaseException) -> None:
        """A failure inside monitoring: log the first of each kind, count all; training goes on.

        Logged by the rank that has it (any rank), with its rank under ``torch.distributed``.
        """
        self.errors += 1
        if kind not in self._error_kinds:
            self._error_kinds.add(kind)
            log.warning("flashwatch%s: %s failed; training goes on unchanged (later failures of this kind are only "
                        "counted in monitor.errors)", self._rank_tag(), kind,
                        exc_info=(type(exc), exc, exc.__traceback__))

    def _warn_once(self, key: Any, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            if self._reporting:
                log.warning(message, *args)

    def _rank_tag(self) -> str:
        return f" (rank {self.rank})" if self.world_size > 1 else ""

    # --- reading -----------------------------------------------------------------------------------
    @property
    def failed_in_a_row(self) -> int:
        """Monitored steps that failed inside flashwatch since the last one it measured (0: the
        latest monitored step was measured). While it is above 0, ``snapshot()`` holds the values
        of an older step: show them as not measured, not as current (the Lightning callback does)."""
        return self._failed_in_a_row

    @property
    def last_failed_step(self) -> int | None:
        """The optimizer step of the latest monitored step that failed inside flashwatch (None if
        none has); while ``failed_in_a_row`` is above 0 it is the latest monitored step."""
        return self._last_failed_step

    @property
    def last_decided_step(self) -> int | None:
        """The optimizer step of the latest decided monitored step (what ``snapshot()`` shows);
        None before the first. Host data: reading it never waits for the device."""
        if self._last_signals is not None:
            return int(self._last_signals.step)
        return None if self._last is None else int(self._last["step"])

    def snapshot(self) -> dict:
        """The latest values, keyed by the metric names of ``flashwatch.metrics.METRICS``.

        Unlabelled metrics are floats (NaN before the first monitored step); labelled ones are
        dicts keyed by label-value tuples: ``(layer, head)`` ints for per-head metrics,
        ``(layer, variant)`` for ``flashwatch_kernel_variant`` (1.0 for the active variant, 0.0
        for ``"sdpa"``, ``"plain"``, ``"fixed"``, ``"fp32_delta"`` otherwise), ``(rule,)`` for
        ``flashwatch_alerts_total`` (every rule, zeros included) and ``(rule, layer, head)`` for
        ``flashwatch_alert_active`` (1.0 while active, 0.0 once cleared).
        """
        # the variants as decided: a switch decided by a flush shows already, as it does when
        # the same step is decided at the next step(); a layer whose calls fall back to torch SDPA shows "sdpa"
        variants = {layer.index: "sdpa" if layer.sdpa_fallback is not None else self._decisions.decided_variant(layer)[1]
                    for layer in self.layers}
        return snapshot(self._last, variants, VARIANT_LABELS, self.alert_counts, self.active_alerts,
                        self._decisions.ever_active)

    def signals(self) -> dict:
        """Signals beside the metric table, from the last monitored step: ``{name: {(layer, head): float}}``.

        Names: ``drift_window_z`` (drift z over the last ``window`` monitored steps),
        ``wq_growth`` (sigma_t / sigma_{t-window}, NaN until the window is full),
        ``wq_ratio_to_median`` (sigma over the layer's median head), ``rows`` (softmax rows seen),
        ``wq_error_push_true`` (the true W^Q gradient's push on sigma_max at that step, the
        denominator's term of ``flashwatch_wq_error_push_share``).
        """
        return extra_signals(self._last)

    @torch.no_grad()
    def wq_spectral_norms(self, exact: bool = False) -> dict[tuple[int, int], float]:
        """W^Q spectral norm per (layer, head) now (a host sync: call it on request, not per step).

        Args:
            exact: recompute with ``torch.linalg.matrix_norm(W_h, ord=2)`` and restart the
                power-iteration vectors from the exact singular vectors; otherwise the current
                power-iteration estimates (as of the last monitored step).
        """
        if self._wq is None:
            return {}
        return self._wq.exact_now() if exact else self._wq.current()

    # --- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: plain Python data and CPU tensors (``torch.save``-able).

        Decides a monitored step still in flight first (``flush``), without changing what training
        does next: the alerts it decides are still returned by the next ``step()``, and its actions
        (``auto_fix`` switches, a ``stop_on`` stop) happen there; they are part of the state, so a
        run resumed from it acts at the same step. After ``detach()`` or ``close()`` the layers'
        part is the one they left (a checkpoint saved after training resumes like one saved during
        it); after ``load_state_dict`` and before ``attach``, the loaded state.
        """
        if self._router is None and self._pending_state is not None:
            return dict(self._pending_state)  # loaded before attach: saved as it is until attach applies it
        self._flush(for_next_step=True)
        signals = self._signals.state_dict()
        layers = [{"name": layer.name, "num_heads": layer.total_heads, "mode": layer.mode,
                   "variant": layer.variant, "power": self._wq.state_of(layer), "signals": sig,
                   "chain": self._chains.state_of(layer)}
                  for layer, sig in zip(self.layers, signals)]
        if self._router is None and self._detached_state is not None:
            layers = self._detached_state["layers"]  # detached (after a fit, close()): the layers as they were left
        return {
            "version": STATE_VERSION,
            "global_step": self.global_step,
            "monitored_steps": self.monitored_steps,
            "config": self.config.to_dict(),
            "layers": layers,
            **self._decisions.state_dict(),
            "errors": self.errors,
            "last": self._last,
            "loss_scale": self._loss_scale.state_dict(),
            "due_alerts": [a.to_dict() for a in self._due_alerts],
            "stops_due": [a.to_dict() for a in self._stops_due],
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``. Before ``attach`` the state is kept and applied at attach.

        A state that does not fit changes nothing: every part is checked (and loaded into new
        objects) before the Monitor or a layer's kernel changes.

        Raises:
            ValueError: the state has another version or misses a part, or its layers (names, head
                counts, head dimensions, window length) differ from the attached model's.
        """
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (1, STATE_VERSION):
            raise ValueError(f"not a flashwatch Monitor state of version {STATE_VERSION} "
                             f"(got version {version if isinstance(state, dict) else type(state).__name__})")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"not a complete flashwatch Monitor state: it has no {', '.join(map(repr, missing))} "
                             "(pass what Monitor.state_dict() returned)")
        if self._router is None:
            self._pending_state = state
            return
        try:
            self._load_checked(state)
        except (KeyError, TypeError, AttributeError, IndexError) as exc:  # a part of the wrong shape or type
            raise ValueError(f"the saved Monitor state is damaged ({type(exc).__name__}: {exc}); pass what "
                             "Monitor.state_dict() returned") from None

    def _load_checked(self, state: dict) -> None:
        """``load_state_dict`` once the state is known complete and the Monitor attached: every part
        is read and checked before any of it is applied."""
        saved = [(s["name"], s["num_heads"]) for s in state["layers"]]
        mine = [(layer.name, layer.total_heads) for layer in self.layers]
        if saved != mine:
            raise ValueError(f"the saved Monitor state has layers {saved}, this model {mine}: resume needs the same "
                             "model and MonitorConfig.layers")
        for i, s in enumerate(state["layers"]):
            if s["mode"] not in MODES or s["variant"] not in VARIANT_LABELS:
                raise ValueError(f"the saved Monitor state is damaged: layer {i} ran mode {s['mode']!r}, variant "
                                 f"{s['variant']!r} (modes: {', '.join(MODES)}; variants: {', '.join(VARIANT_LABELS)})")
        if state["last"] is not None and not isinstance(state["last"], dict):
            raise ValueError(f"the saved Monitor state is damaged: its last step is a {type(state['last']).__name__}, "
                             "not a record")
        # version 1 kept the drift and sigma history at the layer's top level
        signals = SignalBuilder(self._signals.heads, self.config.window)
        signals.load_state_dict([s["signals"] if "signals" in s else {"drift": s["drift"], "sigma": s["sigma"]}
                                 for s in state["layers"]])
        for layer, s in zip(self.layers, state["layers"]):
            if layer.chain is not None and s.get("chain") is not None:
                try:
                    layer.chain.check_state(s["chain"])
                except ValueError as exc:
                    raise ValueError(f"the saved Monitor state does not fit layer {layer.index} ({layer.name}) of "
                                     f"this model: {exc}") from None
        decisions = Decisions(self.config, self._error)
        decisions.load_state_dict(state)
        loss_scale = LossScale(self._warn_once)
        loss_scale.load_state_dict(state.get("loss_scale"))
        counts = {k: int(state[k]) for k in ("global_step", "monitored_steps", "errors")}
        due_alerts = [Alert.from_dict(a) for a in state.get("due_alerts", [])]
        stops_due = [Alert.from_dict(a) for a in state.get("stops_due", [])]
        self._wq.load([s["power"] for s in state["layers"]])  # checks every layer's vectors before it loads one
        # the state fits: from here on nothing refuses it
        saved_config = state.get("config", {})
        if saved_config.get("interval") != self.config.interval:
            log.warning("flashwatch: resuming with interval %s, the saved run used %s",
                        self.config.interval, saved_config.get("interval"))
        # the layers continue with what the saved run ran (auto_fix's switches among it), unless this
        # run asks for another mode or variant: then every layer runs what this run's config says
        asked = (self.config.mode, self.config.variant)
        saved_asked = (saved_config.get("mode"), saved_config.get("variant"))
        new_kernels = "mode" in saved_config and saved_asked != asked
        if new_kernels:
            ran = ", ".join(f"{layer.index}={s['mode']}/{s['variant']}" for layer, s in zip(self.layers, state["layers"]))
            log.warning("flashwatch: resuming with mode=%s variant=%s, the saved run used mode=%s variant=%s: every "
                        "layer runs this run's (the saved run's layers ran %s)", *asked, *saved_asked, ran)
        for layer, s in zip(self.layers, state["layers"]):
            if not new_kernels:
                layer.mode, layer.variant = s["mode"], s["variant"]
            if layer.chain is not None and s.get("chain") is not None:
                layer.chain.load_state_dict(s["chain"])
        self._signals, self._decisions, self._loss_scale = signals, decisions, loss_scale
        self.global_step, self.monitored_steps, self.errors = (counts[k] for k in ("global_step", "monitored_steps",
                                                                                  "errors"))
        self._last = state["last"]
        self._due_alerts, self._stops_due = due_alerts, stops_due
        self._monitoring = self.global_step % self.config.interval == 0
        self._router.monitoring = self._monitoring
        if self._last is not None and self._fan.exporters:  # exporters serving the latest values continue from it
            try:
                record = StepRecord(step=int(self._last["step"]), time=time.time(), snapshot=self.snapshot(),
                                    new_alerts=[], active_alerts=self.active_alerts)
            except Exception as exc:  # the exporters then start as a fresh run's would; the state is loaded
                self._error("resume_export", exc)
            else:
                self._fan.resume(record)


def _check_scalar(name: str, value: Any) -> Any:
    """``value`` if it is None, a real number or a one-element tensor; a one-element numpy array of
    numbers as a float (a host value: no device to wait for); anything else (a bool too) raises."""
    if value is None or isinstance(value, numbers.Real) and not isinstance(value, bool):
        return value
    is_array = type(value).__module__ == "numpy" and getattr(getattr(value, "dtype", None), "kind", "") in "iuf"
    if isinstance(value, torch.Tensor) or is_array:
        if (value.numel() if isinstance(value, torch.Tensor) else value.size) != 1:
            kind = "a numpy array" if is_array else "a tensor"
            raise ValueError(f"{name} must be a float or a one-element tensor, got {kind} of shape {tuple(value.shape)}")
        if isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.dtype.is_complex):
            raise TypeError(f"{name} must be a real number, got a tensor of dtype {value.dtype} (accepted: a float "
                            "or integer tensor of one element)")
        return float(value.reshape(())) if is_array else value
    raise TypeError(f"{name} must be None, a float or a one-element tensor, got {type(value).__name__}")
