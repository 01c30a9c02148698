"""Monitor: the framework-neutral core (schedule, aggregation, detectors, actions, state).

A plain PyTorch loop and the Lightning callback both drive one ``Monitor``: ``attach(model)``
once, ``step(loss=..., grad_norm=...)`` once per optimizer step after ``optimizer.step()``.
The contract is docs/INTERFACES.md; the signal definitions are ../shared/DESIGN.md.

Cost model. Step t is monitored iff ``t % config.interval == 0``; the flag for step t is set at
the end of step t-1 (at attach for step 0), so the attention wrappers read one Python bool.
On unmonitored steps ``step()`` only counts. On a monitored step everything stays on the
device until one host transfer in ``step()``: every layer's ``AttentionStats.packed()``
(through ``_reduce``, the DDP hook), the W^Q power-iteration results and the loss / gradient
norm (if given as device tensors) are concatenated and copied with one ``.cpu()``.

Distributed data parallel (docs/DISTRIBUTED.md): when ``torch.distributed`` is initialized
with more than one process (Lightning's DDP strategy does that; a plain DDP script calls
``init_process_group``), ``attach`` picks up the default process group (``process_group=``
chooses another, or None for none) and every monitored step combines the ranks' statistics,
loss, gradient norm and W^Q norms in one packed all-reduce (``flashwatch.distributed``) before
the host transfer, so every rank decides and acts identically. Every rank must then call
``step()`` once per optimizer step, as every rank calls DDP's backward. Alerts, clearings
and switches are logged by rank 0 only; failures by the rank that has them.

Logged as "flashwatch" (Python ``logging``): each alert once when it starts (warning, or error
when critical), its clearing (info), each auto-fix switch (warning), and the first failure of
each kind inside monitoring (warning with traceback; later ones are only counted in
``errors``).

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

import dataclasses
import logging
import math
import numbers
import time
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .attach import AttentionLayer, Router, find_attention, select_layers
from .config import VARIANTS, MonitorConfig
from .detectors import RULES, Alert, LayerSignals, StepSignals, build_detectors
from .distributed import AUTO, Reducer, resolve_process_group, sharding_of, structural_attention
from .exporters.base import Exporter, FanOut, Layout, StepRecord
from .kernels import STAT_FIELDS
from .metrics import METRICS
from .signals import DriftTracker, PowerIteration, SigmaHistory, ratio_to_median

log = logging.getLogger("flashwatch")

__all__ = ["Monitor", "TrainingStopped"]

STATE_VERSION = 1
VARIANT_LABELS = ("sdpa",) + VARIANTS  # values of the `variant` label of flashwatch_kernel_variant
_VARIANT_CODE = {v: i for i, v in enumerate(VARIANT_LABELS)}  # how ranks compare variants (higher: more fixed)
_STAT_FIELDS = STAT_FIELDS  # rows of AttentionStats.packed(), read by name below


@dataclasses.dataclass
class _Pending:
    """A monitored step between its device half and its host half."""

    step: int
    host: torch.Tensor  # the packed values, on the host (being filled when event is set)
    event: Any  # torch.cuda.Event marking the end of the copy, or None when host is already filled
    finish: Any  # host tensor -> (stats, sigma, loss, grad_norm, loss_given, grad_norm_given) | None
    variants: list | None = None  # what each layer ran at this step (the detectors judge delta drift by it)


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


class _LayerState:
    """The Monitor's host-side signal state of one layer."""

    def __init__(self, layer: AttentionLayer, window: int):
        self.drift = DriftTracker(layer.num_heads, window)
        self.sigma = SigmaHistory(layer.num_heads, window)

    def state_dict(self) -> dict:
        return {"drift": self.drift.state_dict(), "sigma": self.sigma.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.drift.load_state_dict(state["drift"])
        self.sigma.load_state_dict(state["sigma"])


class _WqGroup:
    """Layers whose W^Q have one shape and device, stacked into one batched power iteration.

    One batched iteration for all such layers (usually all of them) keeps the kernel launches
    of a monitored step independent of the depth of the model.
    """

    def __init__(self, layers: list[AttentionLayer], block: int):
        self.layers = layers
        self.power = PowerIteration(self.weight(), block=block, seed="svd")

    def weight(self) -> torch.Tensor:
        ws = [layer.query_weight() for layer in self.layers]
        return ws[0] if len(ws) == 1 else torch.cat(ws)  # (sum H, D, C)

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        return list(t.split([layer.num_heads for layer in self.layers]))

    def state_of(self, i: int) -> dict:
        """Layer ``self.layers[i]``'s slice of the vectors, as plain CPU tensors."""
        state = self.power.state_dict()
        return {"v": self.split(state["v"])[i].clone(), "sigma": self.split(state["sigma"])[i].clone()}

    def load(self, states: list[dict]) -> None:
        self.power.load_state_dict({"v": torch.cat([s["v"] for s in states]),
                                    "sigma": torch.cat([s["sigma"] for s in states])})


_WQ_GROUP_BYTES = 256 * 2**20  # cap on one stacked FP32 copy of query weights (big models get several groups)


def _wq_groups(layers: list[AttentionLayer], block: int) -> list[_WqGroup]:
    groups: list[list] = []  # [(head shape, device), members, FP32 bytes]
    for layer in layers:
        w = layer.query_weight()
        key, size = (tuple(w.shape[1:]), w.device), w.numel() * 4
        group = next((g for g in reversed(groups) if g[0] == key), None)
        if group is None or group[2] + size > _WQ_GROUP_BYTES:
            groups.append([key, [layer], size])
        else:
            group[1].append(layer)
            group[2] += size
    return [_WqGroup(members, block) for _, members, _ in groups]


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
        alerts: every alert raised so far, in order.
        switches: auto-fix switches, dicts with step, layer, name, from, to, rule.
        global_step: optimizer steps seen by ``step()``.
        errors: failures inside monitoring (each kind logged once); training never stops for them.
        detectors: the rule objects (``flashwatch.detectors``), in ``RULES`` order.
        rank, world_size: this process's rank in the group the statistics are combined over,
            and its size (0 and 1 without one), as of ``attach``.
        sharding: why W^Q norms are skipped (a sharded model, e.g. FSDP), or None.

    Raises:
        TypeError: config is not a MonitorConfig.
        flashwatch.TrainingStopped: from ``step()``, for rules in ``config.stop_on``.
    """

    def __init__(self, config: MonitorConfig | None = None, exporters: Sequence[Exporter] = (), *,
                 process_group: Any = AUTO):
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
        self._sharding_hint: str | None = None  # set by an adapter that knows the strategy (FSDP in Lightning)
        self._grad_norm_mode = "max"  # "l2" when each rank passes its own shard's gradient norm (FSDP)
        self.layers: list[AttentionLayer] = []
        self._states: list[_LayerState] = []
        self._wq: list[_WqGroup] = []
        self._router: Router | None = None
        self.global_step = 0
        self.monitored_steps = 0  # monitored steps processed so far (the detectors' warm-up clock)
        self._monitoring = True  # step 0 is monitored
        self.detectors = build_detectors(config)
        self.alerts: list[Alert] = []
        self.alert_counts: dict[str, int] = {rule: 0 for rule in RULES}
        self._ever_active: set[tuple[str, int, int]] = set()
        self.switches: list[dict] = []
        self.errors = 0
        self._error_kinds: set[str] = set()
        self._warned: set = set()
        self._last: dict | None = None
        self._pending_state: dict | None = None  # from load_state_dict() before attach
        self._detached_state: dict | None = None  # from detach(): attaching the same layers again continues
        self._pending: _Pending | None = None  # a monitored step whose host copy is on its way (CUDA)
        self._stops_due: list[Alert] = []  # stop_on alerts decided by flush(), raised at the next step()

    # --- attach / detach --------------------------------------------------------------------------
    def attach(self, model: nn.Module, attention: Mapping[str, Any] | None = None) -> list[AttentionLayer]:
        """Find the attention layers of ``model``, route their attention, open the exporters.

        Args:
            model: the model (nanoGPT-style, Hugging Face GPT-2 / Llama-style found
                automatically; see ``flashwatch.attach``).
            attention: ``{module_name: query_weight_fn}`` for other models, where
                ``query_weight_fn(module)`` returns that layer's W^Q as (heads, head_dim, model_dim).

        Returns:
            the attached layers (also ``monitor.layers``).

        Under ``torch.distributed`` (see ``process_group``) this is where the group is picked
        up; every rank must attach the same model. A sharded model (FSDP, FSDP2, DeepSpeed
        ZeRO-3; ``flashwatch.distributed.sharding_of``) is attached by module structure and its
        W^Q norms are skipped, with one warning saying why.

        Raises:
            RuntimeError: already attached (``detach()`` first).
            ValueError: no attention layer found, or ``config.layers`` selects nothing, or a
                ``process_group`` this process cannot use.
            Whatever an exporter's ``open`` raises (a port in use, ...): nothing stays attached.
        """
        if self._router is not None:
            raise RuntimeError("this Monitor is already attached to a model; call monitor.detach() first")
        group = resolve_process_group(self.process_group)
        sharding = self._sharding_hint or sharding_of(model)
        if sharding is not None and attention is None:
            # a rank holds a shard of each weight between steps: find the layers without reading one
            attention = structural_attention(model)
            if not attention:
                raise ValueError(f"no attention layer found in the sharded model ({sharding}): name them with "
                                 "attach(model, attention={'blocks.0.attn': query_weight_fn, ...})")
        found = select_layers(find_attention(model, attention), self.config.layers)
        own = self.config.mode == "own_kernel"
        layers = []
        for i, (name, module, heads, fn, family) in enumerate(found):
            layer = AttentionLayer(index=i, name=name, module=module, num_heads=heads, query_weight_fn=fn,
                                   family=family, mode=self.config.mode,
                                   variant=self.config.variant if own else "sdpa")
            layer.ensure_stats(layer.query_weight().device)
            layers.append(layer)
        states = [_LayerState(layer, self.config.window) for layer in layers]
        self.sharding = sharding
        self._wq = [] if sharding is not None else _wq_groups(layers, self.config.power_block)
        if group is None:
            self._reducer, self.rank, self.world_size = None, 0, 1
        else:
            reducer = Reducer(*group, [layer.num_heads for layer in layers], n_fields=len(_STAT_FIELDS),
                              max_rows=layers[0].stats.max_rows(), grad_norm=self._grad_norm_mode)
            reducer.check_layout()  # one small collective at attach; raises alike on every rank
            self._reducer, self.rank, self.world_size = reducer, group[1], group[2]
        router = Router(layers, beta=self.config.beta, eps=self.config.eps, on_error=self._error)
        router.monitoring = self._monitoring
        self.layers, self._states, self._router = layers, states, router
        router.install()
        try:
            self._fan.open(Layout(layers=[(layer.name, layer.num_heads) for layer in layers]))
            state, self._pending_state = self._pending_state, None
            resumed, self._detached_state = self._detached_state, None
            if state is None and resumed is not None and [(s["name"], s["num_heads"]) for s in resumed["layers"]] \
                    == [(layer.name, layer.num_heads) for layer in layers]:
                state = resumed  # the same layers again (e.g. a second fit): carry on where detach() left off
            if state is not None:
                self.load_state_dict(state)
        except BaseException:
            self.detach()
            raise
        if self._reporting:
            log.info("flashwatch attached to %d attention layers (%s mode, interval %d): %s", len(layers),
                     self.config.mode, self.config.interval, ", ".join(f"{l.index}={l.name}" for l in layers))
            if self._reducer is not None:
                log.info("flashwatch: statistics, loss, gradient norm and W^Q norms are combined over %d ranks on "
                         "monitored steps (%s); every rank must call monitor.step() once per optimizer step",
                         self.world_size, self._reducer.describe())
            if sharding is not None:
                log.warning("flashwatch: W^Q spectral norms are skipped: %s, so no rank holds a layer's W^Q whole "
                            "between steps (gathering it would cost an all-gather of every query weight per "
                            "monitored step); flashwatch_wq_spectral_norm is NaN and the wq_growth and wq_outlier "
                            "rules are off. Attention statistics, loss and gradient norm are monitored as usual.",
                            sharding)
        return self.layers

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
        self.layers, self._states, self._wq = [], [], []
        self._reducer = None

    def add_exporter(self, exporter: Exporter) -> None:
        """Add an exporter; opened at once if the Monitor is attached (its errors raise)."""
        self._fan.add(exporter)

    @property
    def _reporting(self) -> bool:
        """Whether this process logs alerts and decisions (rank 0 of the group, or a lone process)."""
        return self.rank == 0

    def close(self) -> None:
        """Decide a monitored step still in flight, then close every exporter. Never raises
        (failures are logged and counted)."""
        try:
            self.flush()
        except Exception as exc:
            self._error("flush", exc)
        try:
            self._fan.close()
        except Exception as exc:
            self._error("close", exc)

    # --- schedule ----------------------------------------------------------------------------------
    @property
    def monitoring(self) -> bool:
        """Whether the current optimizer step (``global_step``) is monitored. No sync."""
        return self._monitoring

    @property
    def variants(self) -> dict[int, str]:
        """Layer index -> the variant it runs now (``"sdpa"`` for an observed layer)."""
        return {layer.index: layer.variant for layer in self.layers}

    @property
    def active_alerts(self) -> list[Alert]:
        """Alerts holding now, over all rules."""
        return [a for d in self.detectors for a in d.active]

    def step(self, loss: Any = None, grad_norm: Any = None) -> list[Alert]:
        """Close optimizer step ``global_step``; call once per optimizer step, after ``optimizer.step()``.

        Args:
            loss: the step's training loss, a float or a 0-d (or one-element) tensor; read only
                on monitored steps, inside the single host transfer.
            grad_norm: the global gradient norm before clipping, likewise (None: not tracked).

        Returns:
            alerts that started at this step (empty on unmonitored steps).

        Raises:
            TypeError, ValueError: loss or grad_norm is not a number or one-element tensor.
            TrainingStopped: an alert of a rule in ``config.stop_on`` started at this step.
        """
        _check_scalar("loss", loss)
        _check_scalar("grad_norm", grad_norm)
        t = self.global_step
        ran = [layer.variant for layer in self.layers]  # what step t ran, before a decision below switches one
        new = self._drain()  # an earlier monitored step whose values were still on their way (CUDA)
        if self._monitoring:
            pending = None
            try:
                pending = self._collect(t, loss, grad_norm)
            except Exception as exc:  # monitoring never stops training
                self._error("step", exc)
                self.monitored_steps += 1
            finally:
                self._reset_stats()
            if pending is not None:
                pending.variants = ran
                if pending.event is None:
                    new.extend(self._decide_safely(pending))
                else:
                    self._pending = pending
        self.global_step = t + 1
        self._monitoring = self.global_step % self.config.interval == 0
        if self._router is not None:
            self._router.monitoring = self._monitoring
        stops = [a for a in new if a.rule in self.config.stop_on]
        if stops:
            raise TrainingStopped(stops, stops[0].step)
        return new

    def flush(self) -> list[Alert]:
        """Decide a monitored step whose values are still on their way to the host.

        With ``config.async_transfer`` on CUDA, ``step()`` only starts the host copy of a
        monitored step and decides its alerts at the next ``step()`` call. ``state_dict()``,
        ``detach()`` and ``close()`` flush first, so nothing measured is lost; call it yourself
        before reading ``snapshot()`` or ``alerts`` right after a monitored step. Returns the
        alerts that started (a ``stop_on`` rule among them raises at the next ``step()``).
        """
        new = self._drain()
        self._stops_due.extend(a for a in new if a.rule in self.config.stop_on)
        return new

    def _drain(self) -> list[Alert]:
        new: list[Alert] = []
        if self._stops_due:
            new, self._stops_due = self._stops_due, []
        pending, self._pending = self._pending, None
        if pending is not None:
            new.extend(self._decide_safely(pending))
        return new

    def _decide_safely(self, pending: "_Pending") -> list[Alert]:
        try:
            new = self._decide(pending)
        except Exception as exc:  # monitoring never stops training
            self._error("step", exc)
            new = []
        self.monitored_steps += 1
        return new

    def _start_host_copy(self, values: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The step's one device->host transfer: (host tensor, CUDA event or None).

        On CUDA with ``async_transfer`` the copy goes to pinned memory without waiting and an
        event marks its end; otherwise ``.cpu()`` (a sync point on CUDA)."""
        if values.is_cuda and self.config.async_transfer:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            return host, event
        return values.cpu(), None

    def _reduce(self, packed: torch.Tensor) -> torch.Tensor:
        """Combine this process's packed values with the other ranks' before the host transfer.

        A lone process (no ``process_group``): the identity on ``packed``, the
        (len(STAT_FIELDS), total heads) float64 device tensor of every layer's
        ``AttentionStats.packed()`` side by side, in layer order.

        Under ``torch.distributed``: ``packed`` is ``Reducer.pack``'s vector (statistics, W^Q
        norms, loss, gradient norm, step and variant codes) and the result is
        ``Reducer.all_reduce``'s: one SUM all-reduce in which the rows of
        ``AttentionStats.max_rows()`` (and the other max-combined values) travel in per-rank
        slots (two collectives, SUM then MAX, past ``flashwatch.distributed.SLOT_BYTES_LIMIT``).
        Every rank calls it on every monitored step, also when its own measurement failed.
        """
        return packed if self._reducer is None else self._reducer.all_reduce(packed)

    def _combined_collect(self, t: int, loss: Any, grad_norm: Any) -> "_Pending":
        """This step's values combined over the ranks; ``finish`` gives None when a rank could
        not measure it.

        The collective runs whatever happened on this rank before it (a failure sends a
        "failed" vector), so no rank is left waiting in it; everything after it is decided on
        identical host data, hence identically on every rank.
        """
        r = self._reducer
        device = self.layers[0].stats.device
        try:
            packed = torch.cat([layer.stats.packed().to(device) for layer in self.layers], dim=1)
            sigma = torch.cat([s.to(device=device, dtype=torch.float64) for s in self._wq_sigmas()])
            local = r.pack(packed, sigma, loss, grad_norm, t, [_VARIANT_CODE[layer.variant] for layer in self.layers])
        except Exception as exc:
            self._error("step", exc)
            local = r.failed_local(device)
        # the collective(s) and the one host transfer of the step
        host, event = self._start_host_copy(self._reduce(local))
        return _Pending(t, host, event, lambda values: self._combined_finish(t, values))

    def _combined_finish(self, t: int, host: torch.Tensor):
        r = self._reducer
        red = r.unpack(host)
        if red.failed:
            self._warn_once(("dist", "failed"), "flashwatch: %d of %d ranks could not measure monitored step %d; every "
                            "rank skips it (the failing rank logged why)", red.failed, self.world_size, t)
            return None
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
        return red.stats, red.sigma, red.loss, red.grad_norm, red.loss_given, red.grad_norm_given

    def _warn_once(self, key: Any, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            if self._reporting:
                log.warning(message, *args)

    def _rank_tag(self) -> str:
        return f" (rank {self.rank})" if self.world_size > 1 else ""

    # --- the monitored step ------------------------------------------------------------------------
    def _collect(self, t: int, loss: Any, grad_norm: Any) -> "_Pending":
        """The device half of a monitored step: statistics, W^Q norms, loss and gradient norm
        packed (and reduced over ranks) on the device, their host copy started."""
        if self._reducer is not None and self.layers:
            return self._combined_collect(t, loss, grad_norm)
        return self._local_collect(t, loss, grad_norm)

    def _decide(self, pending: "_Pending") -> list[Alert]:
        """The host half: signals, detectors, alerts, actions and exports of monitored step
        ``pending.step``, once its values are on the host."""
        if pending.event is not None:
            pending.event.synchronize()  # the copy was started a whole optimizer step ago
        values = pending.finish(pending.host)
        if values is None:
            return []
        stats, sigma_all, loss_v, gn_v, loss_given, gn_given = values
        t = pending.step
        cfg = self.config
        heads = [layer.num_heads for layer in self.layers]
        if self.sharding is not None and sigma_all is not None:
            sigma_all = torch.full_like(sigma_all, math.nan)  # skipped: NaN, as the metric shows

        layer_signals = []
        offset = 0
        ran = pending.variants or [layer.variant for layer in self.layers]
        for layer, state, h, variant in zip(self.layers, self._states, heads, ran):
            cols = slice(offset, offset + h)
            offset += h
            layer_signals.append(self._layer_signals(t, layer, state, stats[:, cols], sigma_all[cols], variant))
        signals = StepSignals(step=t, index=self.monitored_steps, loss=loss_v, grad_norm=gn_v, layers=layer_signals,
                              loss_given=loss_given, grad_norm_given=gn_given)
        judged = signals
        if self.sharding is not None:  # skipped W^Q norms are no non-finite values
            judged = dataclasses.replace(signals, layers=[dataclasses.replace(ls, wq_sigma=torch.zeros_like(ls.wq_sigma))
                                                          for ls in layer_signals])

        new: list[Alert] = []
        for det in self.detectors:
            try:
                new.extend(det.update(judged))
            except Exception as exc:
                self._error(f"detector {det.rule}", exc)
            if self._reporting:
                for a in det.cleared:
                    log.info("flashwatch alert cleared [%s] layer %d head %d at step %d", a.rule, a.layer, a.head, t)
        for a in new:
            self.alerts.append(a)
            self.alert_counts[a.rule] += 1
            self._ever_active.add((a.rule, a.layer, a.head))
            if self._reporting:
                log.log(logging.ERROR if a.severity == "critical" else logging.WARNING,
                        "flashwatch alert [%s] step %d: %s", a.rule, a.step, a.message)
        self._last = self._host_record(signals)
        if cfg.auto_fix is not None:
            self._auto_fix(t, [a for a in new if a.rule in cfg.auto_fix_on and a.layer >= 0])
        self._fan.export(StepRecord(step=t, time=time.time(), snapshot=self.snapshot(), new_alerts=list(new),
                                    active_alerts=self.active_alerts))
        return new

    def _local_collect(self, t: int, loss: Any, grad_norm: Any) -> "_Pending":
        """This process's statistics, W^Q norms, loss and gradient norm, in one host transfer."""
        heads = [layer.num_heads for layer in self.layers]
        parts: list[torch.Tensor] = []
        device = None
        if self.layers:
            device = self.layers[0].stats.device
            packed = torch.cat([layer.stats.packed().to(device) for layer in self.layers], dim=1)  # (F, sum H)
            parts.append(self._reduce(packed).reshape(-1))
            parts.append(torch.cat([s.to(device=device, dtype=torch.float64) for s in self._wq_sigmas()]))  # (sum H,)
        on_device = []  # names of the scalars that ride in the transfer, in order
        for name, value in (("loss", loss), ("grad_norm", grad_norm)):
            if isinstance(value, torch.Tensor):
                if device is None:
                    device = value.device
                parts.append(value.detach().reshape(1).to(device=device, dtype=torch.float64))
                on_device.append(name)
        # the one host transfer of the step
        host, event = self._start_host_copy(torch.cat(parts)) if parts else (torch.zeros(0, dtype=torch.float64), None)
        plain = {name: (math.nan if value is None else float(value))
                 for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not isinstance(value, torch.Tensor)}
        given = (loss is not None, grad_norm is not None)

        def finish(host: torch.Tensor):
            total, nf = sum(heads), len(_STAT_FIELDS)
            stats = host[: nf * total].view(nf, total) if heads else None
            sigma_all = host[nf * total: nf * total + total] if heads else None
            tail = dict(zip(on_device, (host[nf * total + total:] if heads else host).tolist()))
            tail.update(plain)
            return stats, sigma_all, tail["loss"], tail["grad_norm"], given[0], given[1]

        return _Pending(t, host, event, finish)

    def _wq_sigmas(self) -> list[torch.Tensor]:
        """This step's W^Q spectral norms, one (H,) device tensor per layer in layer order (NaN on failure).

        A sharded model (``self.sharding``) has no W^Q power iteration: NaN for every head.
        """
        if self.sharding is not None:
            return [torch.full((layer.num_heads,), math.nan, dtype=torch.float64, device=layer.stats.device)
                    for layer in self.layers]
        every = self.config.power_exact_every
        exact = bool(every) and self.monitored_steps % every == every - 1
        out: dict[int, torch.Tensor] = {}
        for group in self._wq:
            try:
                weight = group.weight()
                sigma = group.power.exact(weight) if exact else group.power.step(weight, self.config.power_iters)
            except Exception as exc:
                self._error("wq_spectral_norm", exc)
                sigma = torch.full((sum(layer.num_heads for layer in group.layers),), float("nan"))
            for layer, s in zip(group.layers, group.split(sigma)):
                out[layer.index] = s
        return [out[layer.index] for layer in self.layers]

    def _layer_signals(self, t: int, layer: AttentionLayer, state: _LayerState, stats: torch.Tensor,
                       sigma: torch.Tensor, variant: str | None = None) -> LayerSignals:
        f = {name: stats[i] for i, name in enumerate(_STAT_FIELDS)}  # each (H,) float64, host
        rows = f["rows"]
        seen = bool(rows.sum() > 0)
        if not seen and (layer.index, "no_call") not in self._warned:
            self._warned.add((layer.index, "no_call"))
            if self._reporting:
                log.warning("flashwatch: layer %d (%s) saw no measured attention call during monitored step %d: "
                            "does the model call torch.nn.functional.scaled_dot_product_attention (Hugging Face: "
                            "attn_implementation='sdpa') with gradients enabled?", layer.index, layer.name, t)
        safe_rows = torch.where(rows > 0, rows, torch.ones_like(rows))
        nan = torch.full_like(rows, math.nan)
        if seen:
            state.drift.update(f["delta_error"])
        state.sigma.update(sigma)
        layer.calls = 0
        return LayerSignals(
            layer=layer.index, seen=seen, rows=rows,
            repeated_max_ratio=torch.where(rows > 0, f["repeated_max_rows"] / safe_rows, nan),
            repeated_max_ratio_bf16=torch.where(rows > 0, f["repeated_max_rows_bf16"] / safe_rows, nan),
            max_logit=torch.where(rows > 0, f["max_logit"], nan),
            delta_error=f["delta_error"] if seen else nan,
            delta_cumulative=state.drift.cumulative.clone(), drift_z=state.drift.z, drift_window_z=state.drift.window_z,
            drift_count=state.drift.count.clone(), wq_sigma=sigma.clone(), wq_growth=state.sigma.growth,
            wq_ratio=ratio_to_median(sigma),
            low_precision=True if layer.low_precision is None else layer.low_precision,
            variant=layer.variant if variant is None else variant,
        )

    def _host_record(self, s: StepSignals) -> dict:
        """The last monitored step as plain data (for snapshot(), signals() and state_dict())."""
        per_head = {"repeated_max_ratio": [], "repeated_max_ratio_bf16": [], "max_logit": [], "delta_error": [],
                    "delta_cumulative": [], "drift_z": [], "drift_window_z": [], "wq_sigma": [], "wq_growth": [],
                    "wq_ratio": [], "rows": []}
        for ls in s.layers:
            for key in per_head:
                per_head[key].append(getattr(ls, key).tolist())
        return {"step": s.step, "loss": s.loss, "grad_norm": s.grad_norm, "per_head": per_head}

    def _auto_fix(self, t: int, alerts: list[Alert]) -> None:
        target = self.config.auto_fix
        for a in alerts:
            layer = self.layers[a.layer]
            if layer.mode == "own_kernel" and layer.variant == target:
                continue
            before = layer.variant
            layer.mode, layer.variant = "own_kernel", target
            self.switches.append({"step": t, "layer": layer.index, "name": layer.name, "from": before, "to": target,
                                  "rule": a.rule})
            if self._reporting:
                log.warning("flashwatch auto_fix: layer %d (%s) switched from %s to %s from step %d on (%s at step %d)",
                            layer.index, layer.name, before, target, self.global_step + 1, a.rule, t)

    def _reset_stats(self) -> None:
        for layer in self.layers:
            if layer.stats is not None:
                layer.stats.reset()

    # --- errors ------------------------------------------------------------------------------------
    def _count_error(self) -> None:
        self.errors += 1

    def _on_export_error(self, exporter: Exporter, phase: str, exc: BaseException) -> None:
        self._count_error()

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

    # --- reading -----------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The latest values, keyed by the metric names of ``flashwatch.metrics.METRICS``.

        Unlabelled metrics are floats (NaN before the first monitored step); labelled ones are
        dicts keyed by label-value tuples: ``(layer, head)`` ints for per-head metrics,
        ``(layer, variant)`` for ``flashwatch_kernel_variant`` (1.0 for the active variant, 0.0
        for ``"sdpa"``, ``"plain"``, ``"fixed"``, ``"fp32_delta"`` otherwise), ``(rule,)`` for
        ``flashwatch_alerts_total`` (every rule, zeros included) and ``(rule, layer, head)`` for
        ``flashwatch_alert_active`` (1.0 while active, 0.0 once cleared).
        """
        snap: dict[str, Any] = {m.name: ({} if m.labels else math.nan) for m in METRICS}
        last = self._last
        if last is not None:
            snap["flashwatch_step"] = float(last["step"])
            snap["flashwatch_loss"] = float(last["loss"])
            snap["flashwatch_grad_norm"] = float(last["grad_norm"])
            ph = last["per_head"]
            for metric, key in (("flashwatch_repeated_max_ratio", "repeated_max_ratio"),
                                ("flashwatch_repeated_max_ratio_bf16", "repeated_max_ratio_bf16"),
                                ("flashwatch_max_logit", "max_logit"), ("flashwatch_delta_error", "delta_error"),
                                ("flashwatch_delta_error_cumulative", "delta_cumulative"),
                                ("flashwatch_delta_drift_z", "drift_z"), ("flashwatch_wq_spectral_norm", "wq_sigma")):
                snap[metric] = {(layer, head): float(v) for layer, vals in enumerate(ph[key])
                                for head, v in enumerate(vals)}
        snap["flashwatch_kernel_variant"] = {(layer.index, v): float(v == layer.variant) for layer in self.layers
                                             for v in VARIANT_LABELS}
        snap["flashwatch_alerts_total"] = {(rule,): float(n) for rule, n in self.alert_counts.items()}
        active = {(a.rule, a.layer, a.head) for a in self.active_alerts}
        snap["flashwatch_alert_active"] = {key: float(key in active) for key in sorted(self._ever_active | active)}
        return snap

    def signals(self) -> dict:
        """Signals beside the metric table, from the last monitored step: ``{name: {(layer, head): float}}``.

        Names: ``drift_window_z`` (drift z over the last ``window`` monitored steps),
        ``wq_growth`` (sigma_t / sigma_{t-window}, NaN until the window is full),
        ``wq_ratio_to_median`` (sigma over the layer's median head), ``rows`` (softmax rows seen).
        """
        out: dict[str, dict] = {}
        if self._last is None:
            return {k: {} for k in ("drift_window_z", "wq_growth", "wq_ratio_to_median", "rows")}
        ph = self._last["per_head"]
        for name, key in (("drift_window_z", "drift_window_z"), ("wq_growth", "wq_growth"),
                          ("wq_ratio_to_median", "wq_ratio"), ("rows", "rows")):
            out[name] = {(layer, head): float(v) for layer, vals in enumerate(ph[key]) for head, v in enumerate(vals)}
        return out

    @torch.no_grad()
    def wq_spectral_norms(self, exact: bool = False) -> dict[tuple[int, int], float]:
        """W^Q spectral norm per (layer, head) now (a host sync: call it on request, not per step).

        Args:
            exact: recompute with ``torch.linalg.matrix_norm(W_h, ord=2)`` and restart the
                power-iteration vectors from the exact singular vectors; otherwise the current
                power-iteration estimates (as of the last monitored step).
        """
        out = {}
        for group in self._wq:
            sigma = group.power.exact(group.weight()) if exact else group.power.sigma
            for layer, s in zip(group.layers, group.split(sigma)):
                for head, v in enumerate(s.tolist()):
                    out[(layer.index, head)] = v
        return dict(sorted(out.items()))

    # --- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: plain Python data and CPU tensors (``torch.save``-able).

        Decides a monitored step still in flight first (``flush``)."""
        self.flush()
        return {
            "version": STATE_VERSION,
            "global_step": self.global_step,
            "monitored_steps": self.monitored_steps,
            "config": self.config.to_dict(),
            "layers": [{"name": layer.name, "num_heads": layer.num_heads, "mode": layer.mode,
                        "variant": layer.variant, "power": self._power_state(layer), **state.state_dict()}
                       for layer, state in zip(self.layers, self._states)],
            "detectors": {d.rule: d.state_dict() for d in self.detectors},
            "alerts": [a.to_dict() for a in self.alerts],
            "alert_counts": dict(self.alert_counts),
            "ever_active": sorted(list(k) for k in self._ever_active),
            "switches": [dict(s) for s in self.switches],
            "errors": self.errors,
            "last": self._last,
        }

    def _power_state(self, layer: AttentionLayer) -> dict | None:
        for group in self._wq:
            if layer in group.layers:
                return group.state_of(group.layers.index(layer))
        if self.sharding is not None:
            return None  # W^Q skipped: no power iteration
        raise KeyError(layer.index)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``. Before ``attach`` the state is kept and applied at attach.

        Raises:
            ValueError: the state has another version, or its layers (names, head counts) differ
                from the attached model's.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a flashwatch Monitor state of version {STATE_VERSION} "
                             f"(got version {state.get('version') if isinstance(state, dict) else type(state).__name__})")
        if self._router is None:
            self._pending_state = state
            return
        saved = [(s["name"], s["num_heads"]) for s in state["layers"]]
        mine = [(layer.name, layer.num_heads) for layer in self.layers]
        if saved != mine:
            raise ValueError(f"the saved Monitor state has layers {saved}, this model {mine}: resume needs the same "
                             "model and MonitorConfig.layers")
        if state.get("config", {}).get("interval") != self.config.interval:
            log.warning("flashwatch: resuming with interval %s, the saved run used %s",
                        self.config.interval, state.get("config", {}).get("interval"))
        for layer, st, s in zip(self.layers, self._states, state["layers"]):
            layer.mode, layer.variant = s["mode"], s["variant"]
            st.load_state_dict(s)
        for group in self._wq:
            powers = [state["layers"][layer.index]["power"] for layer in group.layers]
            if all(p is not None for p in powers):  # None: saved by a sharded run, which had no W^Q vectors
                group.load(powers)
        for d in self.detectors:
            if d.rule in state["detectors"]:
                d.load_state_dict(state["detectors"][d.rule])
        self.global_step = int(state["global_step"])
        self.monitored_steps = int(state["monitored_steps"])
        self.alerts = [Alert.from_dict(a) for a in state["alerts"]]
        self.alert_counts = {rule: int(state["alert_counts"].get(rule, 0)) for rule in RULES}
        self._ever_active = {tuple(k) for k in state["ever_active"]}
        self.switches = [dict(s) for s in state["switches"]]
        self.errors = int(state["errors"])
        self._last = state["last"]
        self._monitoring = self.global_step % self.config.interval == 0
        self._router.monitoring = self._monitoring


def _check_scalar(name: str, value: Any) -> None:
    if value is None or isinstance(value, numbers.Real) and not isinstance(value, bool):
        return
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float or a one-element tensor, got a tensor of shape "
                             f"{tuple(value.shape)}")
        return
    raise TypeError(f"{name} must be None, a float or a one-element tensor, got {type(value).__name__}")
