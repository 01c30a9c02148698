"""Figures from recorded runs (matplotlib, rendered offline from the run folders, never on the GPU).

One PNG per (scenario, arm), every seed of the arm drawn over the others, five panels sharing
the step axis:

1. training loss (every step, thin), the blow-up step (dashed vertical line), flashwatch's first
   alert per rule (markers on the loss curve) and the baselines' first alerts (crosses);
2. max over heads of |drift z| (low-precision layers), with the threshold of the replayed config;
3. the BF16 repeated-max ratio (max over heads; FP32-score ratio dashed);
4. max logit (max over heads, log scale) with QK-Clip's tau = 100;
5. W^Q spectral norm of the flagged head (the head of the run's first mechanism alert, else the
   largest), log scale.

Injected scenarios say INJECTED in the title.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .analysis import MECHANISM_RULES, blowup_step, config_for, load_records, replay
from .records import read_run, read_steps

__all__ = ["arm_figure", "figures_for"]

_RULE_MARKERS = {"delta_drift": ("o", "tab:red"), "repeated_max_rise": ("s", "tab:purple"),
                 "wq_growth": ("^", "tab:brown"), "wq_outlier": ("v", "tab:pink"), "max_logit": ("D", "tab:olive"),
                 "non_finite": ("X", "black"), "loss_spike": ("P", "tab:gray")}
_BASE_MARKERS = {"loss_spike": "tab:gray", "zclip": "tab:cyan", "qk_clip": "tab:green"}


def _series(run_dir: Path, overrides: dict | None):
    run = read_run(run_dir)
    steps = read_steps(run_dir)
    records = load_records(run_dir, steps)
    cfg = config_for(run, overrides)
    alerts = replay(records, cfg)
    blow = blowup_step(steps["step"].tolist(), steps["loss"].tolist())
    ms = np.array([r["step"] for r in records])

    def per_step(key, reduce, only_lp=False):
        out = []
        for r in records:
            vals = [x for layer, row in enumerate(r[key]) for x in row
                    if math.isfinite(x) and (not only_lp or r["low_precision"][layer] is not False)]
            out.append(reduce(vals) if vals else math.nan)
        return np.array(out, dtype=float)

    def ratio(key):
        out = []
        for r in records:
            vals = [c / r["rows"][layer] for layer, row in enumerate(r[key]) for c in row
                    if c is not None and r["rows"][layer] > 0]
            out.append(max(vals) if vals else math.nan)
        return np.array(out, dtype=float)

    mech = [a for a in alerts if a.rule in MECHANISM_RULES]
    if mech:
        flagged = (mech[0].layer, mech[0].head)
    elif records:
        last = records[-1]["sigma"]
        flat = [(v, (l, h)) for l, row in enumerate(last) for h, v in enumerate(row) if math.isfinite(v)]
        flagged = max(flat)[1] if flat else (0, 0)
    else:
        flagged = (0, 0)
    sigma = np.array([r["sigma"][flagged[0]][flagged[1]] for r in records], dtype=float)
    from .baselines import run_baselines

    mls = per_step("max_logit", max)
    fired = run_baselines(steps["step"].tolist(), steps["loss"].tolist(), steps["grad_norm"].tolist(), ms.tolist(),
                          mls.tolist())
    firsts = {}
    for a in alerts:
        firsts.setdefault(a.rule, a.step)
    return {"run": run, "steps": steps, "ms": ms, "z": per_step("z", lambda v: max(abs(x) for x in v), True),
            "rm16": ratio("rm16"), "rm32": ratio("rm"), "max_logit": mls, "sigma": sigma, "flagged": flagged,
            "blowup": blow, "first": firsts, "baselines": {b: (v[0] if v else None) for b, v in fired.items()},
            "config": cfg}


def arm_figure(run_dirs: list[Path], out_path: Path, title: str, overrides: dict | None = None) -> Path:
    """Draw one arm's runs (see the module docstring) into ``out_path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [_series(Path(d), overrides) for d in run_dirs]
    fig, axes = plt.subplots(5, 1, figsize=(8, 10), sharex=True, dpi=80)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, d in enumerate(data):
        c = colors[i % len(colors)]
        seed = d["run"]["seed"]
        s = d["steps"]
        ax = axes[0]
        finite = np.isfinite(s["loss"])
        ax.plot(s["step"][finite], s["loss"][finite], color=c, lw=0.6, alpha=0.8, label=f"seed {seed}")
        if d["blowup"] is not None:
            for a in axes:
                a.axvline(d["blowup"], color=c, ls="--", lw=1.0)
        for rule, step in d["first"].items():
            marker, mc = _RULE_MARKERS.get(rule, ("o", "k"))
            idx = np.searchsorted(s["step"], step)
            y = s["loss"][min(idx, len(s["loss"]) - 1)] if len(s["loss"]) else 0
            ax.plot([step], [y if np.isfinite(y) else 0], marker=marker, color=mc, ms=7, mec="k", ls="")
        for b, step in d["baselines"].items():
            if step is not None:
                idx = np.searchsorted(s["step"], step)
                y = s["loss"][min(idx, len(s["loss"]) - 1)] if len(s["loss"]) else 0
                ax.plot([step], [y if np.isfinite(y) else 0], marker="x", color=_BASE_MARKERS[b], ms=8, mew=2, ls="")
        axes[1].plot(d["ms"], d["z"], color=c, lw=0.8)
        axes[2].plot(d["ms"], d["rm16"], color=c, lw=0.8)
        axes[2].plot(d["ms"], d["rm32"], color=c, lw=0.6, ls=":")
        ml = np.where(d["max_logit"] > 0, d["max_logit"], np.nan)
        axes[3].plot(d["ms"], ml, color=c, lw=0.8)
        axes[4].plot(d["ms"], d["sigma"], color=c, lw=0.8, label=f"seed {seed}: layer {d['flagged'][0]} head "
                                                                   f"{d['flagged'][1]}")
    if data:
        cfg = data[0]["config"]
        axes[1].axhline(cfg.drift_threshold, color="tab:red", lw=0.8, ls=":")
    axes[3].axhline(100.0, color="tab:green", lw=0.8, ls=":")
    axes[0].set_ylabel("loss")
    axes[1].set_ylabel("max |drift z|")
    axes[2].set_ylabel("repeated-max\nratio (BF16; FP32 dotted)")
    axes[3].set_ylabel("max logit")
    axes[3].set_yscale("log")
    axes[4].set_ylabel("W^Q sigma\n(flagged head)")
    axes[4].set_yscale("log")
    axes[4].set_xlabel("optimizer step")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[4].legend(fontsize=6, loc="upper left")
    handles = [plt.Line2D([], [], marker=m, color=c, ls="", mec="k", label=r) for r, (m, c) in _RULE_MARKERS.items()]
    handles += [plt.Line2D([], [], marker="x", color=c, ls="", mew=2, label=f"baseline {b}")
                for b, c in _BASE_MARKERS.items()]
    handles.append(plt.Line2D([], [], color="k", ls="--", label="blow-up"))
    fig.legend(handles=handles, fontsize=6, ncol=6, loc="lower center", frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def figures_for(run_dirs: list[Path], out_dir: Path, overrides: dict | None = None) -> list[Path]:
    """One figure per (scenario, arm) among ``run_dirs``; returns the paths written."""
    groups: dict[tuple, list[Path]] = {}
    for d in run_dirs:
        run = read_run(d)
        if run.get("status") == "error":
            continue
        groups.setdefault((run["scenario"], run["arm"]["name"], bool(run.get("tiny"))), []).append(Path(d))
    out = []
    for (scenario, arm, tiny), dirs in sorted(groups.items()):
        run = read_run(dirs[0])
        label = run.get("label") or arm
        inj = " (INJECTED fault)" if run["arm"].get("inject") else ""
        title = f"{scenario}: {label}{'' if 'INJECTED' in label else inj}{' [tiny smoke run]' if tiny else ''}"
        name = f"{scenario}-{arm}{'-tiny' if tiny else ''}{'-INJECTED' if inj else ''}.png"
        dirs = sorted(dirs, key=lambda p: read_run(p)["seed"])
        out.append(arm_figure(dirs, Path(out_dir) / name, title, overrides))
    return out
