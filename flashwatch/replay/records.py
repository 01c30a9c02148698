"""What a run records in its folder, and how it is read back (a training loop writes, the replay reads).

Files of a run folder:

- ``run.json``: the run's spec, status, bounds, timing, versions, the in-training alerts and
  auto-fix switches, the ``MonitorConfig`` it trained with (written at start, rewritten at the end).
- ``steps.csv``: every optimizer step: ``step,loss,grad_norm,lr,time_s`` (the gradient norm
  before clipping; ``time_s`` since the first step).
- ``signals.jsonl`` (``signals.jsonl.gz`` once the run ends): one JSON line per monitored step.
  Per (layer, head): ``e`` (delta error e_t), ``C`` (C_T), ``z`` (drift z), ``zw`` (windowed z),
  ``rm`` / ``rm16`` (repeated-max rows on FP32 / BF16-rounded scores: counts), ``rmf`` (rows
  where P_bar rounds to 1 at two or more keys in MonitorConfig.format: counts; absent in older
  recordings), ``max_logit``,
  ``sigma`` (W^Q spectral norm); per layer ``rows`` (softmax rows measured), ``low_precision``
  and ``variant`` (what the layer ran at that step); the step's ``loss``, ``grad_norm``, ``index``
  (monitored steps before this one), the ``alerts`` that started there, ``monitor_error`` (the
  Monitor failed inside this step: its readings are the previous step's), and ``aligned``
  (true: the line holds the readings of the step it names). Per (layer, head) also the W^Q-error
  chain's readings (``flashwatch.chain``): ``push`` and ``push_true`` (the error's and the true
  gradient's push on sigma_max at this step), ``align`` and ``coh`` (alignment, coherence), rounded
  to float32;
  recordings made before the chain existed have none. Lines without ``aligned`` come from
  older recordings: on CUDA each held the readings of the monitored step *before* the one it
  names and no alerts (``playback.load_records`` corrects that; ``run.json`` has the alerts).

Exactness. ``e``, ``max_logit``, ``sigma``, ``loss`` and ``grad_norm`` are float32 values (the
kernels' statistics, the power iteration, the FP32 loss and norm) and are written as the
shortest decimal that reads back as the same float32; the counts are integers; so the replay
of the detectors (``playback.replay``) sees what the Monitor saw, bit for bit. ``C``, ``z`` and
``zw`` are for reading (6 and 4 significant digits); replay recomputes them from ``e``. A value
that is not a float32 is written as the string ``"d<repr>"`` (exact float64); non-finite
numbers as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.

Size: about 60 bytes per head and monitored step before compression (36 heads, interval 10,
5,000 steps: ~1 MB, ~0.4 MB gzipped).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np

__all__ = ["STEPS_FILE", "SIGNALS_FILE", "RUN_FILE", "StepsWriter", "SignalsWriter", "read_steps", "read_signals",
           "read_run", "write_json_atomic", "f32_text", "read_f32"]

STEPS_FILE = "steps.csv"
SIGNALS_FILE = "signals.jsonl"
RUN_FILE = "run.json"

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _nonfinite_text(x: float) -> str:
    return '"NaN"' if x != x else ('"Infinity"' if x > 0 else '"-Infinity"')


def f32_text(x: float) -> str:
    """JSON text of a float32 value: the shortest decimal that reads back as it (or a tagged float64)."""
    x = float(x)
    if not math.isfinite(x):
        return _nonfinite_text(x)
    v = np.float32(x)
    if float(v) != x:
        return f'"d{x!r}"'
    return str(v)


def _f32_rounded(x: float) -> str:
    """JSON text of x rounded to the nearest float32 (shortest decimal that reads back as it)."""
    return f32_text(float(np.float32(x)))


def _sig_text(x: float, digits: int) -> str:
    x = float(x)
    if not math.isfinite(x):
        return _nonfinite_text(x)
    s = f"{x:.{digits}g}"
    return s if ("e" in s or "." in s or "inf" in s) else s + ".0"


def _read_number(x: Any, plain) -> float:
    """A value written by ``f32_text`` (or a plain number), after ``json.loads(..., parse_float=str)``:
    None -> NaN, the non-finite names, ``"d..."`` (written in float64) as float64, an int as it is,
    and any other string through ``plain``."""
    if x is None:
        return math.nan
    if isinstance(x, str):
        if x in _NONFINITE:
            return _NONFINITE[x]
        if x.startswith("d"):
            return float(x[1:])
        return plain(x)
    return float(x)  # an int


def read_f32(x: Any) -> float:
    """Inverse of ``f32_text`` after ``json.loads(..., parse_float=str)``: the float32 value as a float."""
    return _read_number(x, lambda s: float(np.float32(s)))


def _read_float(x: Any) -> float:
    """As ``read_f32`` for values written in float64: plain strings are read as float64."""
    return _read_number(x, float)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file and a rename (readers never see half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)


def read_run(run_dir: str | os.PathLike) -> dict:
    with open(Path(run_dir) / RUN_FILE) as f:
        return json.load(f)


class StepsWriter:
    """``steps.csv``: one line per optimizer step, written and flushed in batches."""

    def __init__(self, run_dir: str | os.PathLike, append: bool = False):
        path = Path(run_dir) / STEPS_FILE
        self.f = open(path, "a" if append and path.exists() else "w")
        if self.f.tell() == 0:
            self.f.write("step,loss,grad_norm,lr,time_s\n")

    def write(self, rows) -> None:
        """rows: (step, loss, grad_norm, lr, time_s) tuples; loss and grad_norm float32 values."""
        self.f.write("".join(f"{s},{_csv(l)},{_csv(g)},{lr:.6g},{t:.3f}\n" for s, l, g, lr, t in rows))
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def _csv(x: float) -> str:
    return f32_text(x).strip('"')


def read_steps(run_dir: str | os.PathLike) -> dict[str, np.ndarray]:
    """``steps.csv`` as arrays: step (int64), loss, grad_norm, lr, time_s (float64). A cut last line is skipped."""
    path = Path(run_dir) / STEPS_FILE
    cols: dict[str, list] = {"step": [], "loss": [], "grad_norm": [], "lr": [], "time_s": []}
    if path.exists():
        with open(path) as f:
            next(f, None)
            for line in f:
                parts = line.rstrip("\n").split(",")
                if len(parts) != 5 or not line.endswith("\n"):
                    continue
                try:
                    vals = (int(parts[0]), read_f32(parts[1]), read_f32(parts[2]), float(parts[3]), float(parts[4]))
                except ValueError:
                    continue
                for key, v in zip(cols, vals):
                    cols[key].append(v)
    return {"step": np.asarray(cols["step"], dtype=np.int64),
            **{k: np.asarray(v, dtype=np.float64) for k, v in cols.items() if k != "step"}}


def _grid_text(grid: list[list[str]]) -> str:
    return "[" + ",".join("[" + ",".join(row) + "]" for row in grid) + "]"


class SignalsWriter:
    """``signals.jsonl``: one line per monitored step, from the Monitor's public readings.

    Args:
        run_dir: the run folder.
        layout: heads per layer (``[layer.num_heads for layer in monitor.layers]``).
        append: continue an uncompressed file (a run resumed from a checkpoint).
    """

    def __init__(self, run_dir: str | os.PathLike, layout: list[int], append: bool = False):
        self.path = Path(run_dir) / SIGNALS_FILE
        self.layout = list(layout)
        gz = self.path.with_name(self.path.name + ".gz")
        if append and gz.exists() and not self.path.exists():
            # an earlier piece ended compressed (it failed after its checkpoint): continue its lines
            with gzip.open(gz, "rb") as src, open(self.path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            gz.unlink()
        self.f = open(self.path, "a" if append else "w")

    def write(self, step: int, index: int, monitor, alerts, monitor_error: bool, variants: list | None = None,
              low_precision: list | None = None) -> None:
        """Record monitored step ``step`` from ``monitor.snapshot()`` and ``monitor.signals()``.

        Call it once the Monitor has *decided* that step (on CUDA with ``async_transfer``: at the
        next ``step()``), so the readings are that step's. ``index``:
        ``monitor.monitored_steps`` before the step was decided; ``alerts``: the alerts its
        decision returned; ``variants`` / ``low_precision``: what each layer ran at that step
        (default: what it runs now). The line says ``"aligned": true``.
        """
        snap, sig = monitor.snapshot(), monitor.signals()
        if variants is None:
            variants = [layer.variant for layer in monitor.layers]
        if low_precision is None:
            low_precision = [layer.low_precision for layer in monitor.layers]
        layout = self.layout

        def grid(table: dict, fmt) -> str:
            return _grid_text([[fmt(table.get((layer, h), math.nan)) for h in range(n)]
                               for layer, n in enumerate(layout)])

        rows = [float(sig["rows"].get((layer, 0), 0.0)) for layer in range(len(layout))]

        def counts(metric: str) -> str:
            out = []
            for layer, n in enumerate(layout):
                vals = []
                for h in range(n):
                    ratio = snap[metric].get((layer, h), math.nan)
                    ok = rows[layer] > 0 and math.isfinite(ratio)
                    vals.append(str(int(round(ratio * rows[layer]))) if ok else "null")
                out.append(vals)
            return _grid_text(out)

        head = {
            "step": int(step), "index": int(index), "aligned": True,
            "rows": [int(r) for r in rows],
            "low_precision": list(low_precision),
            "variant": list(variants),
            "monitor_error": bool(monitor_error),
            "alerts": [_alert(a) for a in alerts],
        }
        text = json.dumps(head, allow_nan=False, separators=(",", ":"))[:-1]
        parts = [
            f'"loss":{f32_text(snap["flashwatch_loss"])}', f'"grad_norm":{f32_text(snap["flashwatch_grad_norm"])}',
            f'"e":{grid(snap["flashwatch_delta_error"], f32_text)}',
            f'"C":{grid(snap["flashwatch_delta_error_cumulative"], lambda x: _sig_text(x, 6))}',
            f'"z":{grid(snap["flashwatch_delta_drift_z"], lambda x: _sig_text(x, 4))}',
            f'"zw":{grid(sig["drift_window_z"], lambda x: _sig_text(x, 4))}',
            f'"rm":{counts("flashwatch_repeated_max_ratio")}',
            f'"rm16":{counts("flashwatch_repeated_max_ratio_bf16")}',
            f'"rmf":{counts("flashwatch_repeated_max_ratio_format")}',
            f'"max_logit":{grid(snap["flashwatch_max_logit"], f32_text)}',
            f'"sigma":{grid(snap["flashwatch_wq_spectral_norm"], f32_text)}',
            # the chain's readings rounded to float32: read for analysis, not replayed by a detector
            f'"push":{grid(snap["flashwatch_wq_error_push"], _f32_rounded)}',
            f'"push_true":{grid(sig["wq_error_push_true"], _f32_rounded)}',
            f'"align":{grid(snap["flashwatch_wq_error_alignment"], _f32_rounded)}',
            f'"coh":{grid(snap["flashwatch_wq_error_coherence"], _f32_rounded)}',
        ]
        self.f.write(text + "," + ",".join(parts) + "}\n")
        self.f.flush()

    def close(self, compress: bool = True) -> None:
        """Close; with ``compress``, replace the file by ``signals.jsonl.gz``."""
        if self.f.closed:
            return
        self.f.close()
        if compress:
            gz = self.path.with_name(self.path.name + ".gz")
            with open(self.path, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            self.path.unlink()


def _alert(a) -> dict:
    d = a.to_dict()
    for key in ("value", "threshold"):
        v = float(d[key])
        d[key] = v if math.isfinite(v) else ("NaN" if v != v else ("Infinity" if v > 0 else "-Infinity"))
    return d


_F32_FIELDS = ("e", "max_logit", "sigma")
_CHAIN_FIELDS = ("push", "push_true", "align", "coh")
_FLOAT_FIELDS = ("C", "z", "zw")


def _file_lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from f


def _gzip_lines(path: Path, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a gzip file a chunk at a time; a stream cut short (a killed run's) gives what it holds."""
    inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
    rest = b""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            try:
                rest += inflate.decompress(block)
                while inflate.eof and inflate.unused_data:  # a file of several gzip members, one after another
                    tail, inflate = inflate.unused_data, zlib.decompressobj(16 + zlib.MAX_WBITS)
                    rest += inflate.decompress(tail)
            except zlib.error:  # damaged past this point: the lines before it
                break
            *whole, rest = rest.split(b"\n")
            yield from whole
    yield rest


def read_signals(run_dir: str | os.PathLike) -> Iterator[dict]:
    """The monitored-step records in order (``signals.jsonl.gz``, or ``signals.jsonl`` of a cut run).

    Per-head fields come back as lists of lists of floats (NaN where absent), counts as ints or
    None; a line cut by a killed run is skipped.
    """
    run_dir = Path(run_dir)
    gz, plain = run_dir / (SIGNALS_FILE + ".gz"), run_dir / SIGNALS_FILE
    if gz.exists():
        lines = _gzip_lines(gz)
    elif plain.exists():
        lines = _file_lines(plain)
    else:
        return
    for raw in lines:
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw, parse_float=str)
        except ValueError:
            continue
        for key in _F32_FIELDS:
            rec[key] = [[read_f32(x) for x in row] for row in rec[key]]
        for key in _CHAIN_FIELDS:  # absent in recordings made before the W^Q-error chain
            if key in rec:
                rec[key] = [[read_f32(x) for x in row] for row in rec[key]]
        for key in _FLOAT_FIELDS:  # derived (the replay rebuilds them); absent in packed recordings
            if key in rec:
                rec[key] = [[_read_float(x) for x in row] for row in rec[key]]
        rec["loss"], rec["grad_norm"] = read_f32(rec["loss"]), read_f32(rec["grad_norm"])
        for a in rec.get("alerts", ()):
            a["value"], a["threshold"] = _read_float(a["value"]), _read_float(a["threshold"])
        yield rec
