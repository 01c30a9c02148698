"""MonitorConfig: every option of the Monitor in one frozen, keyword-only dataclass.

Each field carries a one-line comment (its manual entry); ``__post_init__`` checks every field
and raises ``ValueError`` naming it (``MonitorConfig.interval must be ...``) and saying what is
accepted. Counts of "steps" in detector settings are *monitored* steps (one every ``interval``
optimizer steps), so ``warmup=20`` with ``interval=10`` is 200 optimizer steps.

Default thresholds and their evidence: calibrated on every valid recording of the project's
experiments (docs/EXPERIMENTS.md, ``results/calibration*.json``; rebuilt by ``bash
results/analyze.sh``): the real BF16 failure on 2x H200 (a byte-level GPT, 6 layers x 6 heads,
lr 3e-3; 2 seeds per arm: 6 runs that blew up at steps 2,514-3,770, 4 healthy references: 2 FP32
controls cut at ~2,280 steps, 2 fp32_delta runs to 5,000), the paper's all-BF16 kernel (2 runs,
blown up at 872 and 886), and the CPU injection scenario (INJECTED fault; 5 healthy, 5 blown up at
559-1,820). "Healthy max" is the largest value on healthy references, "failing min" the smallest,
over blown-up runs, of the largest value before the blow-up. Two seeds per GPU arm: margins, not
proofs.

Re-checked, no default changed, on five seeds per arm (30 real-failure runs on 2x H200,
``results/calibration-real-failure.txt``): 14 blow-ups at 2,514-4,110, each alerted by
``delta_drift`` 1,177-2,510 steps ahead; no alert in 5 FP32 controls (to ~3,730-4,840 steps) and
5 fp32_delta runs; their largest BF16-tie rise 0.236 (margin 0.3), max logit 255, W^Q growth x2.47.

- ``drift_threshold=4.5`` (was 4): failing runs reached |z| 6.1-9.2 on the GPU (min 6.06) and
  4.0-5.9 on the CPU; |z| >= 4.5 came 1,474-2,300 steps before every real-failure blow-up (232
  and 316 before the paper kernel's). Healthy: 3.96 (CPU), and 4.00-4.01 on the SDPA layers of
  the GPU auto_fix runs, which trained fine to step 5,000. 4 had no margin (3.96 against 4.00);
  under a simulated coin-toss null the largest |z| of 36 heads x 500 monitored steps passes 4 in
  3.6 % of runs and 4.5 in 0.3 % (144 heads x 1,000 steps: 15 % and 1.7 %). The windowed z separated no
  better (off). Judged only for layers whose delta comes from the rounded output: the
  fp32_delta runs' residue reached |z| 5.8 and 8.8 while they trained fine (detectors.py).
- ``repeated_max_factor=3`` and ``repeated_max_margin=0.3`` (was 0.1): the rise of a head's BF16
  repeated-max ratio over its baseline reached 0.184 in the FP32 control (still climbing, ~0.01
  per 100 steps, when it was cut at ~2,280 steps; run to ~4,830 steps later it reached 0.236: the
  climb slowed, but this is the thinnest margin of the defaults) and 0.12 in the fp32_delta runs; failing runs reached 0.73-0.92 (GPU) and 0.41-0.68
  (CPU). With 0.1 all four GPU healthy runs alerted. The margin binds; the factor does not.
- ``wq_growth_factor=3`` (was 2), judged only once its comparison point lies after warm-up
  (detectors.py): compared with the initial weights, every healthy run grew x2.4-5.8 by step
  500. After warm-up healthy runs grew at most x2.68 (FP32 control, step 700); failing ones
  x3.4-9.9 on the GPU, mostly in the last 100-500 steps before the blow-up, and x2.7-5.1 on the
  CPU: a weak, late warning with little margin.
- ``wq_outlier_ratio=3``: no signal here (healthy up to 2.2, failing 1.3-4.4); unchanged.
- ``max_logit_bound=1000`` (was 100, QK-Clip's tau): every run, healthy ones included, passes
  100 within ~300 steps (healthy max 227 here, 270 in NUMERICS.md's healthy FP32-attention run;
  another healthy BF16 run there kept 10^4). 1000 stayed quiet on every healthy run and was
  passed 2-431 steps before every GPU blow-up (219-750 on the CPU): it says a failure is under
  way, not that one is coming.
- ``warmup=20``, ``window=50``, ``loss_spike_rtol=2`` (as Lightning's ``SpikeDetection``, for
  comparison): unchanged.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any

from .vocabulary import FIX_VARIANTS, MODES, RULES, VARIANTS


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
    layers: Any = None  # None (all), a regex searched in module names, or a list of module names / indices of attention layers in module order (labels then renumber from 0)

    # --- detectors (counts are monitored steps) --------------------------------------------
    warmup: int = 20  # monitored steps before drift, repeated-max and W^Q rules may fire
    window: int = 50  # W: monitored steps of the windowed drift z and of W^Q growth
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
    loss_spike_window: int = 10  # running mean over this many monitored losses
    clear_ratio: float = 0.9  # hysteresis: an active "above threshold" alert clears below clear_ratio * threshold
    stop_on: frozenset = frozenset()  # rules whose new alerts raise flashwatch.TrainingStopped

    # --- host work -----------------------------------------------------------------------
    async_transfer: bool = True  # CUDA: copy a monitored step's values to the host without waiting and decide its alerts at the next step() (one optimizer step later), so the GPU never drains; False: decide at the monitored step (one host sync there). No effect on the CPU

    # --- W^Q spectral norm ------------------------------------------------------------------
    power_iters: int = 1  # power iterations per monitored step (vectors persist between steps)
    power_block: int = 4  # vectors per head (block power iteration; 1 = classic; see signals.PowerIteration)
    power_exact_every: int = 0  # recompute exactly (torch.linalg.matrix_norm) every N monitored steps; 0: never

    def __post_init__(self) -> None:
        _int(self, "interval", 1)
        _choice(self, "mode", MODES)
        _choice(self, "variant", VARIANTS)
        if self.auto_fix is not None:
            _choice(self, "auto_fix", FIX_VARIANTS, extra="or None")
        _rules(self, "auto_fix_on")
        _number(self, "beta", low=1.0, low_open=True, what="a finite number > 1")
        _number(self, "eps", low=0.0, what="a finite number >= 0 (logits)")
        self._check_layers()
        _int(self, "warmup", 0)
        _int(self, "window", 2)
        _number(self, "drift_threshold", low=0.0, what="a finite number >= 0")
        if self.drift_window_threshold is not None:
            _number(self, "drift_window_threshold", low=0.0, what="None or a finite number >= 0")
        _bool(self, "drift_include_fp32")
        _number(self, "repeated_max_factor", low=1.0, what="a finite number >= 1")
        _number(self, "repeated_max_margin", low=0.0, what="a finite number >= 0 (a fraction of rows)")
        _int(self, "repeated_max_baseline", 1)
        _number(self, "wq_growth_factor", low=1.0, low_open=True, what="a finite number > 1")
        _number(self, "wq_outlier_ratio", low=1.0, low_open=True, what="a finite number > 1")
        _number(self, "max_logit_bound", what="a finite number")
        _number(self, "loss_spike_rtol", low=0.0, what="a finite number >= 0")
        if self.loss_spike_atol is not None:
            _number(self, "loss_spike_atol", low=0.0, what="None or a finite number >= 0")
        _int(self, "loss_spike_window", 1)
        _number(self, "clear_ratio", low=0.0, high=1.0, low_open=True, what="a number in (0, 1]")
        _rules(self, "stop_on")
        _bool(self, "async_transfer")
        _int(self, "power_iters", 1)
        _int(self, "power_block", 1)
        _int(self, "power_exact_every", 0)

    def _check_layers(self) -> None:
        value = self.layers
        if value is None:
            return
        if isinstance(value, str):
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"MonitorConfig.layers: {value!r} is not a valid regular expression ({exc}); "
                                 "accepted: None, a regex, or a list of module names / layer indices") from None
            return
        if isinstance(value, (list, tuple)):
            for item in value:
                ok = isinstance(item, str) or (isinstance(item, int) and not isinstance(item, bool) and item >= 0)
                if not ok:
                    raise ValueError(f"MonitorConfig.layers: entry {item!r} must be a module name (str) or a layer "
                                     "index (int >= 0)")
            if not value:
                raise ValueError("MonitorConfig.layers must not be an empty list; use None to monitor every layer")
            object.__setattr__(self, "layers", tuple(value))  # hashable, immutable
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


def _fail(name: str, value: Any, accepted: str) -> None:
    raise ValueError(f"MonitorConfig.{name} must be {accepted}, got {value!r}")


def _int(cfg: MonitorConfig, name: str, low: int) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        _fail(name, value, f"an int >= {low}")


def _bool(cfg: MonitorConfig, name: str) -> None:
    value = getattr(cfg, name)
    if not isinstance(value, bool):
        _fail(name, value, "True or False")


def _number(cfg: MonitorConfig, name: str, *, low: float | None = None, high: float | None = None,
            low_open: bool = False, what: str) -> None:
    value = getattr(cfg, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _fail(name, value, what)
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
    items = frozenset(value)
    unknown = sorted(str(r) for r in items if r not in RULES)
    if unknown:
        raise ValueError(f"MonitorConfig.{name}: unknown rule(s) {', '.join(unknown)}; accepted: {', '.join(RULES)}")
    object.__setattr__(cfg, name, items)
