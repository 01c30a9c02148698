"""MonitorConfig: every option of the Monitor in one frozen, keyword-only dataclass.

Each field carries a one-line comment (its manual entry); ``__post_init__`` checks every field
and raises ``ValueError`` naming it (``MonitorConfig.interval must be ...``) and saying what is
accepted. Counts of "steps" in detector settings are *monitored* steps (one every ``interval``
optimizer steps), so ``warmup=20`` with ``interval=10`` is 200 optimizer steps.

The default thresholds were calibrated on recorded training runs, healthy and failing:
docs/CALIBRATION.md says, per setting, on which recordings and with what margin. Margins seen on
small GPTs are not guarantees: for a model with hundreds of heads raise ``drift_threshold`` (e.g.
5), or set it above the largest |z| a healthy run of yours reaches (``flashwatch_delta_drift_z``).
"""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import re
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

from .vocabulary import FIX_VARIANTS, FORMATS, MODES, RULES, VARIANTS

# The longest windows accepted, in monitored steps. ``window`` keeps, per attention head, the last
# W values of five float64 series on the host (delta error, W^Q norm, and the three trends):
# 40 bytes per head per monitored step, held in memory, recomputed from on every monitored step
# and written into every checkpoint. At 10,000 that is 0.4 MB per head (410 MB for 1,024 heads)
# and about 10 million values per layer-head set read per monitored step: bounded, unlike 10**8
# (4 GB per head). ``loss_spike_window`` keeps W floats and sums them every monitored step.
MAX_WINDOW = 10_000
WINDOW_BYTES_PER_HEAD = 40  # per monitored step of ``window`` (5 float64 series)


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """Options of ``flashwatch.Monitor``. Keyword-only; invalid values raise ``ValueError``.

    Example::

        cfg = MonitorConfig(interval=10, mode="observe", auto_fix="fp32_delta",
                            stop_on={"non_finite"})
        monitor = Monitor(cfg)

    Raises:
        ValueError: naming the field (``MonitorConfig.<field>``), its value and what is accepted.
    """

    # --- schedule and kernel ---------------------------------------------------------------
    interval: int = 10  # monitor every `interval` optimizer steps (step t monitored iff t % interval == 0)
    mode: str = "observe"  # "observe": keep the model's SDPA and measure beside it; "own_kernel": run flashwatch's kernel
    variant: str = "plain"  # kernel variant of every layer at start in own_kernel mode: "plain", "fixed", "fp32_delta"
    auto_fix: str | None = None  # None, or the variant ("fixed" | "fp32_delta") a flagged layer is switched to
    auto_fix_on: frozenset = frozenset({"delta_drift", "repeated_max_rise"})  # rules whose alerts trigger auto_fix
    beta: float = 2.0  # the fixed variant's factor (> 1): it subtracts beta*max on repeated-max rows
    eps: float = 1e-3  # tie tolerance in logits for repeated-max rows (>= 0)
    format: str = "bf16"  # number format of the attention's P_bar V product: "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp4" (flashwatch_repeated_max_ratio_format counts ties on its grid)
    layers: Any = None  # None (all), a regex searched in module names, or a list of module names / indices of attention layers in module order (labels then renumber from 0)

    # --- detectors (counts are monitored steps) --------------------------------------------
    warmup: int = 20  # monitored steps before drift, repeated-max and W^Q rules may fire
    window: int = 50  # W: monitored steps of the windowed drift z and of W^Q growth (2 to 10,000: 40 bytes of host memory per head per step)
    drift_threshold: float = 4.5  # delta_drift fires when |z| (cumulative) >= this
    drift_window_threshold: float | None = None  # also fire when the windowed |z| >= this (None: off)
    drift_include_fp32: bool = False  # also judge drift of layers whose delta is not taken from a rounded output: FP32 attention (rounding noise) and the fp32_delta variant (a residue; the remedy)
    repeated_max_factor: float = 3.0  # repeated_max_rise: BF16 ratio >= factor * its baseline ...
    repeated_max_margin: float = 0.3  # ... and >= baseline + margin (absolute, a fraction of rows)
    repeated_max_baseline: int = 20  # monitored steps after warm-up averaged into each head's baseline
    wq_growth_factor: float = 3.0  # wq_growth fires when sigma_t / sigma_(t-window) >= this, once t-window is past warm-up
    wq_outlier_ratio: float = 3.0  # wq_outlier fires when a head's sigma / its layer's median sigma >= this
    max_logit_bound: float = 1000.0  # max_logit (warning) fires when a head's max logit >= this
    loss_spike_rtol: float = 2.0  # loss_spike: loss - running mean >= rtol * |running mean| (Lightning's default)
    loss_spike_atol: float | None = None  # ... and >= atol if set
    loss_spike_window: int = 10  # running mean over this many monitored losses (1 to 10,000)
    clear_ratio: float = 0.9  # hysteresis: an active "above threshold" alert clears below clear_ratio * threshold
    clear_steps: int = 10  # hysteresis in time (warning rules): an alert's episode ends only after its condition was clear at this many consecutive monitored steps
    alert_gap: int = 20  # warning rules: after an episode ended, monitored steps before the same (rule, layer, head) may start a new alert
    stop_on: frozenset = frozenset()  # rules whose new alerts raise flashwatch.TrainingStopped

    # --- host work -----------------------------------------------------------------------
    async_transfer: bool = True  # CUDA: copy a monitored step's values to the host without waiting and decide its alerts at the next step() (one optimizer step later), so the GPU never drains; False: decide at the monitored step (one host sync there). No effect on the CPU

    # --- W^Q spectral norm ------------------------------------------------------------------
    power_iters: int = 1  # power iterations per monitored step (vectors persist between steps)
    power_block: int = 4  # vectors per head (block power iteration; 1 = classic; see signals.PowerIteration)
    power_exact_every: int = 0  # recompute exactly (torch.linalg.matrix_norm) every N monitored steps; 0: never

    # --- W^Q-gradient error chain -------------------------------------------------------------
    wq_error_chain: bool = True  # measure flashwatch_wq_error_* (the statistics pass also accumulates P K and maps each row's delta error onto W^Q); False: those metrics read NaN (not measured) and a monitored step does less work

    def __post_init__(self) -> None:
        _int(self, "interval", 1)
        _choice(self, "mode", MODES)
        _choice(self, "variant", VARIANTS)
        if self.variant != "plain" and self.mode != "own_kernel":
            raise ValueError(f"MonitorConfig.variant={self.variant!r} needs mode='own_kernel' (flashwatch's kernel "
                             f"runs the attention); in mode={self.mode!r} the model keeps its own attention. Use "
                             f"mode='own_kernel', or auto_fix={self.variant!r} to switch the layers an alert flags")
        if self.auto_fix is not None:
            _choice(self, "auto_fix", FIX_VARIANTS, extra="or None")
        _rules(self, "auto_fix_on")
        if self.auto_fix is not None and not self.auto_fix_on:
            raise ValueError(f"MonitorConfig.auto_fix={self.auto_fix!r} with an empty auto_fix_on would never switch "
                             f"a layer: name the rules whose alerts switch it (out of {', '.join(RULES)}; default "
                             f"{', '.join(sorted(MonitorConfig.auto_fix_on))}), or pass auto_fix=None")
        _number(self, "beta", low=1.0, low_open=True, what="a finite number > 1")
        _number(self, "eps", low=0.0, what="a finite number >= 0 (logits)")
        _choice(self, "format", FORMATS)
        self._check_layers()
        _int(self, "warmup", 0)
        _int(self, "window", 2, high=MAX_WINDOW,
             why=f"; each monitored step of the window costs {WINDOW_BYTES_PER_HEAD} bytes of host memory per "
                 "attention head (five float64 series, kept in memory and in every checkpoint)")
        _number(self, "drift_threshold", low=0.0, what="a finite number >= 0")
        if self.drift_window_threshold is not None:
            _number(self, "drift_window_threshold", low=0.0, what="None or a finite number >= 0")
        _bool(self, "drift_include_fp32")
        _number(self, "repeated_max_factor", low=1.0, what="a finite number >= 1")
        _number(self, "repeated_max_margin", low=0.0, high=1.0, what="a number in [0, 1] (a fraction of rows)")
        _int(self, "repeated_max_baseline", 1)
        _number(self, "wq_growth_factor", low=1.0, low_open=True, what="a finite number > 1")
        _number(self, "wq_outlier_ratio", low=1.0, low_open=True, what="a finite number > 1")
        _number(self, "max_logit_bound", what="a finite number")
        _number(self, "loss_spike_rtol", low=0.0, what="a finite number >= 0")
        if self.loss_spike_atol is not None:
            _number(self, "loss_spike_atol", low=0.0, what="None or a finite number >= 0")
        _int(self, "loss_spike_window", 1, high=MAX_WINDOW,
             why="; the window's losses are kept and summed on every monitored step")
        _number(self, "clear_ratio", low=0.0, high=1.0, low_open=True, what="a number in (0, 1]")
        _int(self, "clear_steps", 1, high=MAX_WINDOW)
        _int(self, "alert_gap", 0, high=MAX_WINDOW)
        _rules(self, "stop_on")
        _bool(self, "async_transfer")
        _int(self, "power_iters", 1)
        _int(self, "power_block", 1)
        _int(self, "power_exact_every", 0)
        _bool(self, "wq_error_chain")

    def _check_layers(self) -> None:
        value = self.layers
        if value is None:
            return
        if isinstance(value, str):
            if not value:
                raise ValueError("MonitorConfig.layers must not be an empty string (it would match every module name); "
                                 "use None to monitor every layer, or a regex such as r'\\.h\\.(0|1)\\.'")
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"MonitorConfig.layers: {value!r} is not a valid regular expression ({exc}); "
                                 "accepted: None, a regex, or a list of module names / layer indices") from None
            return
        if isinstance(value, (list, tuple)):
            for item in value:
                ok = isinstance(item, str) or (_is_int(item) and item >= 0)
                if not ok:
                    raise ValueError(f"MonitorConfig.layers: entry {item!r} must be a module name (str) or a layer "
                                     "index (int >= 0)")
            if not value:
                raise ValueError("MonitorConfig.layers must not be an empty list; use None to monitor every layer")
            # hashable, immutable; numpy integers become ints
            object.__setattr__(self, "layers", tuple(item if isinstance(item, str) else int(item) for item in value))
            return
        raise ValueError(f"MonitorConfig.layers must be None, a regex string, or a list of module names / "
                         f"layer indices, got {type(value).__name__}")

    def to_dict(self) -> dict:
        """Plain-data copy (frozensets as sorted lists), e.g. for a checkpoint or a log line."""
        out = asdict(self)
        for k, v in out.items():
            if isinstance(v, frozenset):
                out[k] = sorted(v)
            elif isinstance(v, tuple):
                out[k] = list(v)
        return out


def _keywords_named(init: Callable[..., None]) -> Callable[..., None]:
    """MonitorConfig's generated ``__init__``, refusing positional arguments and unknown keywords
    with an error that lists the fields (and the nearest one to a misspelling)."""
    @functools.wraps(init)
    def checked(self: MonitorConfig, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"MonitorConfig takes keywords only, e.g. MonitorConfig(interval=10), got {len(args)} "
                            f"positional argument(s)")
        names = [f.name for f in fields(MonitorConfig)]
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                near = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
            raise TypeError(f"MonitorConfig has no field {', '.join(hints)}; its fields: {', '.join(names)}")
        init(self, **kwargs)
    return checked


MonitorConfig.__init__ = _keywords_named(MonitorConfig.__init__)  # type: ignore[method-assign]


def _fail(name: str, value: Any, accepted: str) -> None:
    raise ValueError(f"MonitorConfig.{name} must be {accepted}, got {value!r}")


def _is_numpy_bool(value: Any) -> bool:
    """numpy's bool scalar (``np.bool_``), recognised without importing numpy."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool")


def _is_int(value: Any) -> bool:
    """An integer that means a number: ``numbers.Integral`` (int, numpy integers), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _int(cfg: MonitorConfig, name: str, low: int, *, high: int | None = None, why: str = "") -> None:
    value = getattr(cfg, name)
    accepted = f"an int >= {low}" + ("" if high is None else f" and <= {high:,}")
    if not _is_int(value) or value < low or (high is not None and value > high):
        _fail(name, value, accepted + why)
    object.__setattr__(cfg, name, int(value))


def _bool(cfg: MonitorConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, bool) and not _is_numpy_bool(value):
        _fail(name, value, "True or False")
    object.__setattr__(cfg, name, bool(value))


def _number(cfg: MonitorConfig, name: str, *, low: float | None = None, high: float | None = None,
            low_open: bool = False, what: str) -> None:
    """A real number (``numbers.Real``: int, float, numpy scalars), never a bool; stored as a float."""
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        _fail(name, value, what + (" (a bool is not a number)" if isinstance(value, bool) else ""))
    if low is not None and (value <= low if low_open else value < low):
        _fail(name, value, what)
    if high is not None and value > high:
        _fail(name, value, what)
    object.__setattr__(cfg, name, float(value))


def _choice(cfg: MonitorConfig, name: str, choices: tuple, extra: str = "") -> None:
    value = getattr(cfg, name)
    if value not in choices:
        _fail(name, value, "one of " + ", ".join(repr(c) for c in choices) + (f" {extra}" if extra else ""))


def _rules(cfg: MonitorConfig, name: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        _fail(name, value, f"a set of rule names out of {', '.join(RULES)}")
    items = list(value)
    if not all(isinstance(r, str) for r in items):
        _fail(name, value, f"a set of rule names (strings) out of {', '.join(RULES)}")
    items = frozenset(items)
    unknown = sorted(str(r) for r in items if r not in RULES)
    if unknown:
        raise ValueError(f"MonitorConfig.{name}: unknown rule(s) {', '.join(unknown)}; accepted: {', '.join(RULES)}")
    object.__setattr__(cfg, name, items)
