"""Figures from recorded runs (matplotlib, rendered offline from the run folders, never on the GPU).

One PNG per (scenario, arm), every seed of the arm drawn over the others, five panels sharing
the step axis:

1. training loss (every step, thin), the blow-up step (dashed vertical line), flashwatch's first
   alert per rule (markers on the loss curve), the baselines' first alerts (crosses) and
   auto_fix switches (dotted vertical lines);
2. max over heads of |drift z| of the layers the delta_drift rule judges (delta from the rounded
   output), with the threshold of the replayed config; dotted: layers running fp32_delta (not
   judged: the residue of rounding P_bar, shown for honesty);
3. the BF16 repeated-max ratio (max over heads; FP32-score ratio dotted);
4. max logit (max over heads, log scale) with QK-Clip's tau = 100 and the max_logit bound;
5. W^Q spectral norm of the flagged head (the head of the run's first mechanism alert, else the
   largest), log scale.

And one overview per scenario with several arms (``SCENARIO-overview.png``): a column per arm,
rows loss, max |drift z| and BF16 repeated-max ratio.

Injected scenarios say INJECTED in the title. PNGs are written at 72 dpi with a 256-colour
palette (tens of kB each).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from flashwatch.replay.baselines import run_baselines
from flashwatch.replay.blowup import blowup_step
from flashwatch.replay.playback import build_signals, config_for, load_records, replay
from flashwatch.replay.records import read_run, read_steps
from flashwatch.replay.runs import MECHANISM_RULES
from flashwatch.vocabulary import INJECTED

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
    if records and "z" not in records[0]:  # packed recordings (research.recordings): drift z rebuilt by the replay
        by_step = {sig.step: sig for sig in build_signals(records, cfg.window)}
        for r in records:
            sig = by_step.get(int(r["step"]))
            r["z"] = [ls.drift_z.tolist() for ls in sig.layers] if sig is not None else \
                [[math.nan] * len(row) for row in r["e"]]
    alerts = replay(records, cfg)
    blow = blowup_step(steps["step"].tolist(), steps["loss"].tolist())
    ms = np.array([r["step"] for r in records])

    def per_step(key, reduce, layers_ok=lambda r, layer: True):
        out = []
        for r in records:
            vals = [x for layer, row in enumerate(r[key]) for x in row if math.isfinite(x) and layers_ok(r, layer)]
            out.append(reduce(vals) if vals else math.nan)
        return np.array(out, dtype=float)

    def variant(r, layer):
        return (r.get("variant") or [None] * len(r["e"]))[layer]

    def judged(r, layer):  # as delta_drift: delta from the rounded output
        return r["low_precision"][layer] is not False and variant(r, layer) != "fp32_delta"

    def residue(r, layer):
        return r["low_precision"][layer] is not False and variant(r, layer) == "fp32_delta"

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
    mls = per_step("max_logit", max)
    fired = run_baselines(steps["step"].tolist(), steps["loss"].tolist(), steps["grad_norm"].tolist(), ms.tolist(),
                          mls.tolist())
    firsts = {}
    for a in alerts:
        firsts.setdefault(a.rule, a.step)
    absmax = lambda v: max(abs(x) for x in v)  # noqa: E731
    return {"run": run, "steps": steps, "ms": ms, "z": per_step("z", absmax, judged),
            "z_fp32_delta": per_step("z", absmax, residue), "switches": [sw["step"] for sw in run.get("switches", [])],
            "rm16": ratio("rm16"), "rm32": ratio("rm"), "max_logit": mls, "sigma": sigma, "flagged": flagged,
            "blowup": blow, "first": firsts, "baselines": {b: (v[0] if v else None) for b, v in fired.items()},
            "config": cfg}


def arm_figure(run_dirs: list[Path], out_path: Path, title: str, overrides: dict | None = None) -> Path:
    """Draw one arm's runs (see the module docstring) into ``out_path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [_series(Path(d), overrides) for d in run_dirs]
    fig, axes = plt.subplots(5, 1, figsize=(7.5, 9.5), sharex=True, dpi=72)
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
        for sw in d["switches"]:
            axes[0].axvline(sw, color=c, ls=":", lw=1.0)
        axes[1].plot(d["ms"], d["z"], color=c, lw=0.8)
        if np.isfinite(d["z_fp32_delta"]).any():
            axes[1].plot(d["ms"], d["z_fp32_delta"], color=c, lw=0.8, ls=":")
        axes[2].plot(d["ms"], d["rm16"], color=c, lw=0.8)
        axes[2].plot(d["ms"], d["rm32"], color=c, lw=0.6, ls=":")
        ml = np.where(d["max_logit"] > 0, d["max_logit"], np.nan)
        axes[3].plot(d["ms"], ml, color=c, lw=0.8)
        axes[4].plot(d["ms"], d["sigma"], color=c, lw=0.8, label=f"seed {seed}: layer {d['flagged'][0]} head "
                                                                   f"{d['flagged'][1]}")
    if data:
        cfg = data[0]["config"]
        axes[1].axhline(cfg.drift_threshold, color="tab:red", lw=0.8, ls="--")
        axes[3].axhline(cfg.max_logit_bound, color="tab:olive", lw=0.8, ls="--")
    axes[3].axhline(100.0, color="tab:green", lw=0.8, ls=":")
    labels = ("loss", "max |drift z|", "repeated-max ratio", "max logit", "W^Q sigma")
    notes = ("", "layers delta_drift judges; dotted: fp32_delta layers (not judged); dashed: threshold",
             "BF16-rounded scores; dotted: FP32 scores", "dotted: QK-Clip tau 100; dashed: max_logit bound",
             "the flagged head (first mechanism alert, else the largest)")
    for ax, label, note in zip(axes, labels, notes):
        ax.set_ylabel(label, fontsize=9)
        if note:
            ax.text(0.01, 0.97, note, transform=ax.transAxes, fontsize=7, va="top", color="0.3")
    axes[3].set_yscale("log")
    axes[4].set_yscale("log")
    axes[4].set_xlabel("optimizer step")
    axes[0].legend(fontsize=7, loc="upper right")
    axes[4].legend(fontsize=6, loc="lower right")
    handles = [plt.Line2D([], [], marker=m, color=c, ls="", mec="k", label=r) for r, (m, c) in _RULE_MARKERS.items()]
    handles += [plt.Line2D([], [], marker="x", color=c, ls="", mew=2, label=f"baseline {b}")
                for b, c in _BASE_MARKERS.items()]
    handles.append(plt.Line2D([], [], color="k", ls="--", label="blow-up"))
    handles.append(plt.Line2D([], [], color="k", ls=":", label="auto_fix switch"))
    fig.legend(handles=handles, fontsize=6, ncol=6, loc="lower center", frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    return _save(fig, out_path)


def _save(fig, out_path) -> Path:
    """Write ``fig`` as a small PNG (256-colour palette) and close it."""
    import io

    import matplotlib.pyplot as plt

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    try:
        from PIL import Image

        buf.seek(0)
        Image.open(buf).convert("RGB").quantize(256).save(out_path, optimize=True)
    except ImportError:  # pragma: no cover - matplotlib's own PNG, larger
        out_path.write_bytes(buf.getvalue())
    return out_path


def overview_figure(groups: list[tuple[str, list[Path]]], out_path: Path, title: str,
                    overrides: dict | None = None) -> Path:
    """One column per arm (``groups``: (arm label, run folders)), rows: loss with blow-ups and
    first alerts, max |drift z| (judged layers; fp32_delta dotted) and the BF16 repeated-max ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(groups)
    fig, axes = plt.subplots(3, n, figsize=(2.2 * n + 0.8, 6.2), sharex=True, sharey="row", dpi=72, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    zmax = 0.0
    for j, (label, dirs) in enumerate(groups):
        for i, d in enumerate(_series(Path(p), overrides) for p in dirs):
            c = colors[i % len(colors)]
            s = d["steps"]
            finite = np.isfinite(s["loss"])
            axes[0, j].plot(s["step"][finite], s["loss"][finite], color=c, lw=0.5, alpha=0.8,
                            label=f"seed {d['run']['seed']}")
            if d["blowup"] is not None:
                for a in axes[:, j]:
                    a.axvline(d["blowup"], color=c, ls="--", lw=0.9)
            for sw in d["switches"]:
                axes[0, j].axvline(sw, color=c, ls=":", lw=0.9)
            for rule, step in d["first"].items():
                if rule in ("delta_drift", "repeated_max_rise"):
                    marker, mc = _RULE_MARKERS[rule]
                    axes[0, j].plot([step], [2.9 - 0.15 * i], marker=marker, color=mc, mec=c, mew=1.5, ms=7, ls="")
            axes[1, j].plot(d["ms"], d["z"], color=c, lw=0.7)
            if np.isfinite(d["z_fp32_delta"]).any():
                axes[1, j].plot(d["ms"], d["z_fp32_delta"], color=c, lw=0.7, ls=":")
            zmax = max(zmax, float(np.nanmax(np.concatenate([d["z"], d["z_fp32_delta"], [0.0]]))))
            axes[2, j].plot(d["ms"], d["rm16"], color=c, lw=0.7)
            cfg = d["config"]
        axes[1, j].axhline(cfg.drift_threshold, color="tab:red", lw=0.8, ls="--")
        axes[0, j].set_title(label, fontsize=9)
        axes[2, j].set_xlabel("step", fontsize=8)
        for a in axes[:, j]:
            a.tick_params(labelsize=7)
    axes[0, 0].set_ylim(0.3, 3.1)
    axes[1, 0].set_ylim(0, max(6.0, zmax * 1.05))
    axes[0, 0].set_ylabel("loss", fontsize=8)
    axes[1, 0].set_ylabel("max |drift z|", fontsize=8)
    axes[2, 0].set_ylabel("BF16 repeated-max\nratio (max head)", fontsize=8)
    axes[0, 0].legend(fontsize=6, loc="lower left")
    handles = [plt.Line2D([], [], marker=_RULE_MARKERS[r][0], color=_RULE_MARKERS[r][1], ls="", label=f"first {r}")
               for r in ("delta_drift", "repeated_max_rise")]
    handles += [plt.Line2D([], [], color="k", ls="--", lw=0.9, label="blow-up"),
                plt.Line2D([], [], color="k", ls=":", lw=0.9, label="auto_fix switch / fp32_delta residue z"),
                plt.Line2D([], [], color="tab:red", ls="--", lw=0.8, label="drift threshold")]
    fig.legend(handles=handles, fontsize=7, ncol=5, loc="lower center", frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return _save(fig, out_path)


ARM_ORDER = ("sdpa_observe", "plain", "fixed", "fp32_delta", "auto_fix", "fp32", "paper", "plain_fast", "fp32_fast",
             "healthy", "injected", "injected_auto_fix", "injected_fixed", "injected_fp32_delta")


def figures_for(run_dirs: list[Path], out_dir: Path, overrides: dict | None = None) -> list[Path]:
    """One figure per (scenario, arm) among ``run_dirs``, and an overview per scenario with two
    arms or more; returns the paths written."""
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
        inj = f" ({INJECTED} fault)" if run["arm"].get("inject") else ""
        title = f"{scenario}: {label}{'' if INJECTED in label else inj}{' [tiny smoke run]' if tiny else ''}"
        name = f"{scenario}-{arm}{'-tiny' if tiny else ''}{'-' + INJECTED if inj else ''}.png"
        dirs = sorted(dirs, key=lambda p: read_run(p)["seed"])
        out.append(arm_figure(dirs, Path(out_dir) / name, title, overrides))
    scenarios = sorted({(sc, tiny) for sc, _, tiny in groups})
    for scenario, tiny in scenarios:
        arms = sorted((arm for sc, arm, t in groups if (sc, t) == (scenario, tiny)),
                      key=lambda a: (ARM_ORDER.index(a) if a in ARM_ORDER else len(ARM_ORDER), a))
        if len(arms) < 2:
            continue
        cols = []
        for arm in arms:
            dirs = sorted(groups[(scenario, arm, tiny)], key=lambda p: read_run(p)["seed"])
            cols.append((read_run(dirs[0]).get("label") or arm, dirs))
        injected = any(INJECTED in label for label, _ in cols)
        title = f"{scenario}: every arm{f' ({INJECTED} fault in the arms so labelled)' if injected else ''}" \
                f"{' [tiny smoke run]' if tiny else ''}"
        name = f"{scenario}-overview{'-tiny' if tiny else ''}.png"
        out.append(overview_figure(cols, Path(out_dir) / name, title, overrides))
    return out
