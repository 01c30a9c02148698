"""The bias lab: the paper's rounding arithmetic, and the signed rounding bias of each kernel.

``python -m research.lab`` measures, for every attention kernel at hand, whether its BF16
output O and the delta = rowsum(dO * O) taken from it err in one direction on rows whose max
score repeats (the mechanism of Qiu & Yao, docs/LAB.md), against other rows.

Inputs (docs/LAB.md): q ~ N(0, scale^2) with query scale 4 or 1, k ~ N(0, 1) with every key
duplicated (K[2j+1] = K[2j], so the top score of almost every causal row is an exact tie),
v ~ N(-2, 0.5^2) (mostly negative), rounded to BF16; a control without duplicated keys (query
scale 4). Causal, sm_scale = 1/sqrt(D). dO ~ N(1, 1) in BF16: its mean is not zero on purpose,
because the delta error of a row is sum_d dO_d err_d, whose expectation is zero for a zero-mean
dO however biased O is; a real model's dO is not zero-mean noise (the experiments saw the delta
error keep one sign for thousands of steps, docs/EXPERIMENTS.md). The zero-mean control is in
the JSON (``delta_zero_mean_do``). All drawn on the CPU from one seeded generator, so CPU and
GPU runs see the same numbers.

Errors, per kernel:
- O: err = O_kernel - O_exact, O_exact the float64 attention of the same BF16 inputs.
- delta (from the stored output): e = rowsum(dO * O_kernel) - rowsum(dO * O_exact) in float64:
  the delta error of a backward that takes delta from the output it stored (FA2, cuDNN, the
  flashwatch ``plain`` and ``fixed`` variants, the paper's code).
- delta used by the backward (flashwatch variants): read back from the kernel's own
  ``AttentionStats`` after a backward with the same dO: sum over rows of delta_used - delta_hp
  as the monitor sees it (delta_hp in FP32). For ``fp32_delta`` this is the delta it really
  uses (from the FP32 output), which the stored-output number above does not show.
- delta as the paper's backward computes it (paper kernels): rowsum(dO * O) in BF16 arithmetic
  (products and sum rounded to BF16), minus the exact delta.

Kernels: flashwatch ``plain``, ``fixed``, ``fp32_delta`` (``flashwatch.kernels.flash_attention``:
the Triton kernel on CUDA, the PyTorch reference on the CPU); the paper's all-BF16 emulation
(``kernels/paper.py``, tile 512) without and with its fix; torch SDPA: on CUDA the flash (FA2)
and cuDNN backends, on the CPU the math backend and the CPU flash backend. Each kernel's entry
in the JSON says where its backward takes delta from (``delta_source``). A kernel that fails to
run (a backend missing on this machine) is recorded with its error and the lab goes on.

Low-precision formats (``format_kernels``; ``research.format_attention``): P_bar and V rounded to
FP8 E4M3, FP8 E5M2 and MXFP4 for the P_bar V product, FP32 accumulation, BF16 output, for the
variants ``plain``, ``fixed`` (the fix at the format's grid), ``fp32_delta`` and ``rounded_sum``
(divide by the row sum of the rounded P_bar); and ``plain``/``rounded_sum`` with P_bar alone
rounded (V in BF16). For these, "delta used" is rowsum(dO * O_used) - the exact delta in
float64, O_used the output the variant's backward takes delta from. ``formats`` in the JSON
gathers them per format x variant (``format_table``).

Inputs recorded from a real model (``research.lab_inputs``): the real-failure recipe's GPT at a
few points of its training (``--model-size``, or ``--model-inputs`` for a file recorded on a
GPU), measured like the synthetic sets; their ``spec`` says what they are.

Rows are split into tie rows (the max of the float64 scores repeats within eps = 1e-3, as
the Monitor's repeated-max rows are defined) and other rows. For each group:
- z (features): for each feature d, z_d = mean of err[:, d] / its standard error over rows;
  z = the mean of z_d over d, with max |z_d|.
- z (pooled): the mean over rows and features divided by its standard error with rows as the
  independent units (a row's features share one normalisation, so their errors correlate and
  counting elements as independent would overstate z).
- delta: z = mean of e / its standard error over rows; z_heads the same with (batch, head) pairs
  as the units (each the mean over its rows): rows of one head share K and V, and rounded V's
  errors, which makes z over rows overstate; z_heads does not.
Under no bias z is about N(0, 1); rows of one head share K and V, so read |z| < 3 as noise.
z grows like sqrt(rows) under a fixed bias: compare kernels at one shape, and shapes by z/sqrt(n).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

__all__ = ["paper_example", "PAPER_TERMS", "InputSpec", "INPUTS", "make_inputs", "exact_attention",
           "bias_stats", "row_stats", "run_lab", "render", "build_parser", "main", "DEFAULT_SHAPES"]

EPS = 1e-3
DEFAULT_SHAPES = {  # (B, H, N, D)
    "cuda": (8, 8, 1024, 64),   # the shape of the original GPU measurement (docs/LAB.md)
    "cpu": (4, 8, 1024, 64),    # 32k rows, two 512-tiles per row as on the GPU: ~35 s on 2 cores
    "quick": (2, 4, 256, 64),   # ~2k rows: a few seconds
}

# ---------------------------------------------------------------------------------------------
# The paper's worked example (section 3 of Qiu & Yao)

PAPER_TERMS = (-2.40625, -0.00087, -2.296875)  # V of two tied keys (BF16 values), the others' remainder


def paper_example() -> dict:
    """-2.40625 + -0.00087 + -2.296875 rounded to BF16, as a kernel forms one element of P_bar V.

    The two tied keys have P_bar = 1, so their terms are their V values, BF16 numbers in [2, 4)
    (spacing 2**-6); their sum lies in [4, 8) (spacing 2**-5), so it is exactly representable or
    exactly halfway: here halfway (-4.703125). On its own ties-to-even would round it towards
    zero (-4.6875); the small remainder of the other tokens, of the same sign, tips it away from
    zero (-4.71875). The sum is accumulated in FP32 (as a matrix product does) and rounded once.

    Returns: dict with the terms, ``exact`` (float64 sum), ``bf16`` (the rounded result),
    ``error`` (bf16 - exact), ``ulp`` (BF16 spacing at the result), ``tied_sum`` (the two tied
    terms alone, exact), ``tied_sum_bf16`` (that sum rounded: ties-to-even), ``halfway``
    (whether the tied sum sits halfway between two BF16 numbers).
    """
    a, rest, b = PAPER_TERMS
    for x in (a, b):
        if float(torch.tensor(x).to(torch.bfloat16)) != x:
            raise AssertionError(f"{x} is not a BF16 value")  # the example's premise
    exact = a + rest + b
    acc = torch.tensor(PAPER_TERMS, dtype=torch.float32).sum()
    rounded = float(acc.to(torch.bfloat16))
    tied = a + b
    tied_rounded = float(torch.tensor(tied, dtype=torch.float32).to(torch.bfloat16))
    ulp = 2.0 ** (math.floor(math.log2(abs(rounded))) - 7)
    return {
        "terms": list(PAPER_TERMS),
        "exact": exact,
        "bf16": rounded,
        "error": rounded - exact,
        "ulp": ulp,
        "tied_sum": tied,
        "tied_sum_bf16": tied_rounded,
        "halfway": (abs(tied) / ulp) % 1.0 == 0.5,
    }


# ---------------------------------------------------------------------------------------------
# Inputs and the exact reference


@dataclass(frozen=True)
class InputSpec:
    name: str
    duplicate_keys: bool
    query_scale: float


INPUTS = (
    InputSpec("dup_q4", True, 4.0),     # duplicated keys, query scale 4
    InputSpec("dup_q1", True, 1.0),     # duplicated keys, query scale 1
    InputSpec("nodup_q4", False, 4.0),  # control: no duplicated keys
)


DO_MEAN = 1.0


def make_inputs(spec: InputSpec, shape, seed: int, device="cpu", do_mean: float = DO_MEAN):
    """(q, k, v, dO) in BF16 on ``device``, drawn on the CPU from one seeded generator.

    The same seed gives the same q, k, v and the same dO noise whatever ``do_mean``.
    """
    B, H, N, D = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=g) * spec.query_scale
    k = torch.randn(B, H, N, D, generator=g)
    if spec.duplicate_keys:
        k[:, :, 1::2] = k[:, :, 0:N - 1:2]  # K[2j+1] = K[2j]
    v = torch.randn(B, H, N, D, generator=g) * 0.5 - 2.0
    do = torch.randn(B, H, N, D, generator=g) + do_mean
    return tuple(t.to(torch.bfloat16).to(device) for t in (q, k, v, do))


@torch.no_grad()
def exact_attention(q, k, v, eps: float = EPS):
    """float64 causal attention of the given inputs, and the tie rows.

    Returns (O (B, H, N, D) float64, tie (B, H, N) bool: the max score repeats within eps).
    Computed one batch entry at a time to bound memory (B x (H, N, N) float64).
    """
    outs, ties = [], []
    N, D = q.shape[2], q.shape[3]
    mask = torch.ones(N, N, dtype=torch.bool, device=q.device).triu(1)
    for b in range(q.shape[0]):
        qb, kb, vb = (t[b].to(torch.float64) for t in (q, k, v))
        s = torch.matmul(qb, kb.transpose(-1, -2)) / math.sqrt(D)
        s.masked_fill_(mask, float("-inf"))
        top = torch.topk(s, min(2, N), dim=-1).values
        ties.append(top[..., 1] >= top[..., 0] - eps if N > 1 else torch.zeros_like(top[..., 0], dtype=torch.bool))
        outs.append(torch.matmul(torch.softmax(s, dim=-1), vb))
    return torch.stack(outs), torch.stack(ties)


# ---------------------------------------------------------------------------------------------
# Statistics


def _z(mean: torch.Tensor, std: torch.Tensor, n: int) -> torch.Tensor:
    se = std / math.sqrt(n)
    z = mean / se
    # no spread: z is 0 if the mean is 0 too (all errors zero), undefined otherwise
    return torch.where(se > 0, z, torch.where(mean == 0, torch.zeros_like(z), torch.full_like(z, float("nan"))))


def _num(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def bias_stats(err: torch.Tensor, rows: torch.Tensor) -> dict:
    """Signed bias of an output error ``err`` (B, H, N, D) on the rows selected by ``rows`` (B, H, N).

    Returns {"n", "mean", "mean_abs", "z_feat", "max_abs_z_feat", "z_pooled"}; z values are None
    with fewer than 2 rows (or when undefined).
    """
    e = err[rows].to(torch.float64).cpu()  # (n, D)
    n = e.shape[0]
    out = {"n": n, "mean": None, "mean_abs": None, "z_feat": None, "max_abs_z_feat": None, "z_pooled": None}
    if n == 0:
        return out
    out["mean"] = _num(e.mean())
    out["mean_abs"] = _num(e.abs().mean())
    if n < 2:
        return out
    zd = _z(e.mean(0), e.std(0), n)
    out["z_feat"] = _num(zd.mean())
    out["max_abs_z_feat"] = _num(zd.abs().max())
    r = e.mean(1)
    out["z_pooled"] = _num(_z(r.mean(), r.std(), n))
    return out


def row_stats(e: torch.Tensor, rows: torch.Tensor) -> dict:
    """Signed bias of a per-row error ``e`` (B, H, N) on ``rows``: {"n", "mean", "mean_abs", "z", "z_heads"}.

    ``z`` takes rows as the independent units; ``z_heads`` takes the (batch, head) pairs, each
    contributing the mean error of its selected rows: rows of one head share K and V, and where V
    itself is rounded (the low-precision formats) they share its rounding errors too, which
    makes ``z`` overstate; ``z_heads`` does not (None with fewer than 2 pairs)."""
    x = e[rows].to(torch.float64).cpu()
    n = x.shape[0]
    out = {"n": n, "mean": None, "mean_abs": None, "z": None, "z_heads": None}
    if n:
        out["mean"], out["mean_abs"] = _num(x.mean()), _num(x.abs().mean())
    if n >= 2:
        out["z"] = _num(_z(x.mean(), x.std(), n))
    counts = rows.sum(-1).to(torch.float64).cpu()
    sums = torch.where(rows, e, torch.zeros_like(e)).sum(-1).to(torch.float64).cpu()
    means = sums[counts > 0] / counts[counts > 0]
    if means.numel() >= 2:
        out["z_heads"] = _num(_z(means.mean(), means.std(), means.numel()))
    return out


def _split(fn, err, tie):
    return {"tie": fn(err, tie), "other": fn(err, ~tie), "all": fn(err, torch.ones_like(tie))}


# ---------------------------------------------------------------------------------------------
# Kernels


@dataclass
class Kernel:
    name: str
    description: str
    run: Callable  # (q, k, v) -> O in BF16
    delta_source: str           # where its backward takes delta from
    variant: str | None = None  # flashwatch variant: also read delta_used from AttentionStats
    bf16_delta: bool = False    # its backward computes delta in BF16 arithmetic (the paper's)
    fmt: str | None = None      # P_bar V operand format (research.format_attention): run returns (O, O_used)


def _sdpa(backend):
    def run(q, k, v):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


def kernels_for(device: torch.device, tile: int = 512) -> list[Kernel]:
    from flashwatch.kernels import flash_attention, uses_triton
    from flashwatch.kernels.paper import paper_attention

    impl = "Triton kernel" if uses_triton(device) else "PyTorch reference"
    from_output = "rowsum(dO*O) of its stored BF16 output, FP32 arithmetic"
    ks = [Kernel(f"flashwatch_{variant}", f"flashwatch.kernels.flash_attention variant={variant} ({impl})",
                 lambda q, k, v, variant=variant: flash_attention(q, k, v, variant=variant),
                 "rowsum(dO*(O+R)): the FP32 output kept by the forward" if variant == "fp32_delta" else from_output,
                 variant=variant)
          for variant in ("plain", "fixed", "fp32_delta")]
    paper_delta = "rowsum(dO*O) of its stored output in BF16 arithmetic (the public code's backward)"
    ks += [Kernel("paper", f"paper's all-BF16 tiled FA2 emulation, tile {tile} (kernels/paper.py)",
                  lambda q, k, v: paper_attention(q, k, v, tile=tile), paper_delta, bf16_delta=True),
           Kernel("paper_fixed", f"the same with the paper's per-tile fix (fixed=True), tile {tile}",
                  lambda q, k, v: paper_attention(q, k, v, tile=tile, fixed=True), paper_delta, bf16_delta=True)]
    from research.lab_formats import format_kernels

    ks += format_kernels()
    try:
        from torch.nn.attention import SDPBackend
    except ImportError:  # torch < 2.3
        return ks
    if device.type == "cuda":
        ks += [Kernel("sdpa_flash", "torch SDPA, FLASH_ATTENTION backend (FA2)", _sdpa(SDPBackend.FLASH_ATTENTION),
                      from_output),
               Kernel("sdpa_cudnn", "torch SDPA, CUDNN_ATTENTION backend", _sdpa(SDPBackend.CUDNN_ATTENTION),
                      from_output)]
    else:
        ks += [Kernel("sdpa_math", "torch SDPA, MATH backend, BF16 inputs (CPU)", _sdpa(SDPBackend.MATH),
                      "none: autograd through softmax forms rowsum(P*dP), not rowsum(dO*O)"),
               Kernel("sdpa_flash_cpu", "torch SDPA, FLASH_ATTENTION backend on the CPU",
                      _sdpa(SDPBackend.FLASH_ATTENTION), from_output)]
    return ks


def _stats_delta(kernel: Kernel, q, k, v, do) -> dict:
    """delta_used - delta_hp summed by the kernel's own AttentionStats after one backward."""
    from flashwatch.kernels import AttentionStats, flash_attention

    stats = AttentionStats(q.shape[1], q.device)
    qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = flash_attention(qq, kk, vv, variant=kernel.variant, stats=stats)
    out.backward(do)
    d = stats.as_dict()
    n = int(sum(d["rows"]))
    s1, s2 = sum(d["delta_error"]), sum(d["delta_error_sq"])
    var = (s2 - s1 * s1 / n) / (n - 1) if n > 1 else float("nan")
    z = s1 / math.sqrt(n * var) if n > 1 and var > 0 else (0.0 if s1 == 0 else float("nan"))
    return {"rows": n, "tie_rows": int(sum(d["repeated_max_rows"])), "sum": s1,
            "sum_tie": sum(d["delta_error_tied"]), "sum_abs": sum(d["delta_error_abs"]), "sum_sq": s2,
            "z_all": _num(z)}


def _measure(kernel: Kernel, q, k, v, exact, tie, grads, with_backward: bool) -> dict:
    """``grads``: {"delta": (dO, exact delta), "delta_zero_mean_do": (dO0, exact delta)}."""
    t0 = time.perf_counter()
    with torch.no_grad():
        out = kernel.run(q, k, v)
    out, o_used = out if isinstance(out, tuple) else (out, None)
    if out.device.type == "cuda":
        torch.cuda.synchronize()
    res = {"seconds_forward": time.perf_counter() - t0, "dtype": str(out.dtype).replace("torch.", "")}
    o64 = out.to(torch.float64)
    res["out"] = _split(bias_stats, o64 - exact, tie)
    for name, (do, delta_exact) in grads.items():
        res[name] = _split(row_stats, (do.to(torch.float64) * o64).sum(-1) - delta_exact, tie)
    do, delta_exact = grads["delta"]
    if kernel.bf16_delta:  # as the paper's backward: product and row sum in BF16
        d16 = (do * out.to(do.dtype)).sum(-1).to(torch.float64)
        res["delta_bf16"] = _split(row_stats, d16 - delta_exact, tie)
    if o_used is not None:  # the delta its backward uses
        u64 = o_used.to(torch.float64)
        res["delta_used"] = _split(row_stats, (do.to(torch.float64) * u64).sum(-1) - delta_exact, tie)
    if kernel.variant is not None and with_backward:
        res["delta_used_stats"] = _stats_delta(kernel, q, k, v, do)
    return res


# ---------------------------------------------------------------------------------------------
# The lab


def _versions() -> dict:
    v = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    try:
        import triton

        v["triton"] = triton.__version__
    except Exception:  # no triton wheel on this platform
        v["triton"] = None
    from flashwatch import __version__

    v["flashwatch"] = __version__
    return v


def _device_info(device: torch.device) -> dict:
    info = {"type": device.type, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
        info["bf16_reduced_precision_reduction"] = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    else:
        info["name"] = platform.processor() or platform.machine()
    info["math_sdp_bf16_reduction"] = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    return info


def _input_sets(inputs, model_inputs, shape, seed, dev):
    """(spec dict, (q, k, v, dO, zero-mean dO)) per input set: synthetic, then recorded."""
    for spec in inputs:
        q, k, v, do = make_inputs(spec, shape, seed, dev)
        do0 = make_inputs(spec, shape, seed, dev, do_mean=0.0)[3]
        yield {**asdict(spec), "source": "synthetic"}, (q, k, v, do, do0)
    for rec in model_inputs:
        # the zero-mean control: N(0, 1) noise of the recorded dO's spread, seeded
        g = torch.Generator().manual_seed(seed)
        do0 = (torch.randn(rec.do.shape, generator=g) * rec.do.float().std()).to(torch.bfloat16)
        yield rec.describe(), tuple(t.to(dev) for t in (rec.q, rec.k, rec.v, rec.do, do0))


def run_lab(device: str = "cpu", *, shape=None, seed: int = 0, quick: bool = False, tile: int = 512,
            with_backward: bool = True, inputs=INPUTS, model_inputs=(),
            progress: Callable[[str], None] | None = None) -> dict:
    """Measure every kernel on every input set; returns a JSON-ready dict (see the module docstring).

    Args:
        device: "cpu" or "cuda".
        shape: (B, H, N, D); None means DEFAULT_SHAPES[device] (or "quick").
        seed: seed of the input generator.
        quick: smaller default shape (tests, smoke runs).
        tile: the paper emulation's tile size.
        with_backward: also run each flashwatch variant's backward for its AttentionStats delta.
        inputs: the InputSpecs to run.
        model_inputs: ``research.lab_inputs.RecordedInputs`` (a real model's attention calls) to run
            after them, with their own shapes and dO.
        progress: called with one line per kernel and input set.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch.cuda.is_available() is False; use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if shape is None:
        shape = DEFAULT_SHAPES["quick" if quick else dev.type]
    shape = tuple(int(x) for x in shape)
    started = time.perf_counter()
    result = {
        "what": "signed rounding bias of O and delta on tie rows vs other rows (python -m research.lab)",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": None,  # set by the command line entry point
        "device": _device_info(dev),
        "versions": _versions(),
        "shape": {"B": shape[0], "H": shape[1], "N": shape[2], "D": shape[3]},
        "dtype": "bfloat16",
        "causal": True,
        "seed": seed,
        "eps": EPS,
        "paper_tile": tile,
        "do_mean": DO_MEAN,
        "paper_example": paper_example(),
        "inputs": {},
        "kernels": {},
    }
    kernels = kernels_for(dev, tile)
    result["kernels"] = {kn.name: {"description": kn.description, "delta_source": kn.delta_source, "format": kn.fmt}
                         for kn in kernels}
    for spec, (q, k, v, do, do0) in _input_sets(inputs, model_inputs, shape, seed, dev):
        exact, tie = exact_attention(q, k, v)
        grads = {name: (g, (g.to(torch.float64) * exact).sum(-1))
                 for name, g in (("delta", do), ("delta_zero_mean_do", do0))}
        entry = {"spec": spec, "rows": int(tie.numel()), "tie_rows": int(tie.sum()), "results": {}}
        for kn in kernels:
            try:
                entry["results"][kn.name] = _measure(kn, q, k, v, exact, tie, grads, with_backward)
            except Exception as exc:  # a backend missing here is a result, not a crash
                entry["results"][kn.name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            if progress:
                r = entry["results"][kn.name]
                z = r.get("out", {}).get("tie", {}).get("z_feat") if "out" in r else None
                progress(f"{spec['name']:9s} {kn.name:22s} " + (r["error"] if "error" in r else f"O tie z={_fmt(z)}"))
        result["inputs"][spec["name"]] = entry
    from research.lab_formats import format_table

    result["formats"] = format_table(result)
    result["seconds"] = time.perf_counter() - started
    return result


# ---------------------------------------------------------------------------------------------
# Output


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:+.{digits}f}"


def _pair(stats: dict) -> str:
    return f"{_fmt(stats['z_feat'])} / {_fmt(stats['z_pooled'])}"


def _used(r: dict, delta_source: str) -> str:
    """The delta the kernel's backward uses: its own stats (flashwatch), BF16 arithmetic (paper)."""
    if "delta_used_stats" in r:
        u = r["delta_used_stats"]
        return f"{_fmt(u['z_all'])}  {u['sum_abs'] / max(u['rows'], 1):.1e} (stats, all rows)"
    if "delta_bf16" in r:
        d = r["delta_bf16"]
        return f"{_fmt(d['tie']['z'])} / {_fmt(d['other']['z'])}  {d['all']['mean_abs']:.1e} (bf16)"
    if "delta_used" in r:
        d = r["delta_used"]
        return f"{_fmt(d['tie']['z'])} / {_fmt(d['other']['z'])}  {d['all']['mean_abs']:.1e}"
    return "n/a (softmax autograd)" if delta_source.startswith("none") else "= delta"


def _title(name: str, entry: dict) -> str:
    spec = entry["spec"]
    n_tie, n_all = entry["tie_rows"], entry["rows"]
    what = (f"duplicated keys {spec['duplicate_keys']}, query scale {spec['query_scale']:g}"
            if spec.get("source") == "synthetic" else
            f"recorded: layer {spec['layer']} of the '{spec['size']}' real-failure recipe at step {spec['step']}, "
            f"shape {'x'.join(map(str, spec['shape']))}")
    return f"{name}: {what}; tie rows {n_tie}, other rows {n_all - n_tie}"


def render(result: dict, console=None) -> None:
    """Print the paper example and one table per input set (rich)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    ex = result["paper_example"]
    console.print(
        f"[bold]Paper example[/bold]: {ex['terms'][0]} + {ex['terms'][1]} + {ex['terms'][2]} -> "
        f"{ex['bf16']} in BF16 (exact {ex['exact']:.5f}, error {ex['error']:+.4f}); the tied terms "
        f"alone sum to {ex['tied_sum']}, halfway, which ties-to-even would round to {ex['tied_sum_bf16']}.")
    s, dev = result["shape"], result["device"]
    console.print(
        f"device {dev['type']} ({dev.get('name')}), B={s['B']} H={s['H']} N={s['N']} D={s['D']}, bf16, causal, "
        f"seed {result['seed']}, dO mean {result['do_mean']:g}, torch {result['versions']['torch']}.\n"
        "z = mean signed error / its standard error; O: mean of per-feature z / pooled (rows as units); "
        "|z| < 3 is noise, z grows like sqrt(rows) under a fixed bias. delta: rowsum(dO*O) from the "
        "stored output. used: the delta the backward really uses (z, mean |error|).")
    for name, entry in result["inputs"].items():
        table = Table(title=_title(name, entry), title_justify="left")
        table.add_column("kernel")
        for col in ("O tie z", "O other z", "O mean|err|", "delta tie z", "delta other z", "used delta"):
            table.add_column(col, justify="right")
        for kname, r in entry["results"].items():
            if "error" in r:
                table.add_row(kname, f"[dim]{r['error'][:70]}[/dim]", "", "", "", "", "")
                continue
            o, d = r["out"], r["delta"]
            mean_abs = o["all"]["mean_abs"]
            table.add_row(kname, _pair(o["tie"]), _pair(o["other"]), "-" if mean_abs is None else f"{mean_abs:.2e}",
                          _fmt(d["tie"]["z"]), _fmt(d["other"]["z"]),
                          _used(r, result["kernels"][kname]["delta_source"]))
        console.print(table)
    from research.lab_formats import format_table

    names = list(result["inputs"])
    table = Table(title="P_bar and V in a low-precision format: z of the delta the backward uses, all rows, with "
                        "rows / (batch, head) pairs as units (mean |delta error|)", title_justify="left")
    table.add_column("format x variant")
    for name in names:
        table.add_column(name, justify="right")
    for row in format_table(result):
        table.add_row(row["kernel"], *(f"{_fmt(row[n]['z_all'])} / {_fmt(row[n]['z_heads'])} ({row[n]['mean_abs']:.1e})"
                                       if n in row else "-" for n in names))
    console.print(table)
    console.print(f"{result['seconds']:.1f} s")


PROG = "python -m research.lab"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="The bias lab: signed rounding bias of O and delta per "
                                                       "attention kernel, on tie rows against other rows "
                                                       "(docs/LAB.md). Run from the repository root.")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--json", metavar="PATH", help="write every number as JSON")
    p.add_argument("--quick", action="store_true", help="smaller default shape (a few seconds on a CPU)")
    p.add_argument("--shape", metavar="B,H,N,D",
                   help="override the shape (default: 8,8,1024,64 on cuda, 4,8,1024,64 on cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the input generator (default 0)")
    p.add_argument("--tile", type=int, default=512, help="tile size of the paper emulation (default 512)")
    p.add_argument("--model-inputs", metavar="PATH",
                   help="a real model's attention inputs recorded by python -m research.lab_inputs (default: "
                        "record them now with --model-size)")
    p.add_argument("--model-size", choices=("none", "quick", "cpu", "full"), default=None,
                   help="train the real-failure recipe at this size and record its attention inputs (default: "
                        "cpu, quick with --quick; none: synthetic inputs only)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m research.lab``; returns the exit status."""
    args = build_parser().parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = None
    if args.shape:
        try:
            shape = tuple(int(x) for x in args.shape.split(","))
            if len(shape) != 4 or min(shape) < 1:
                raise ValueError
        except ValueError:
            print(f"{PROG}: --shape must be four positive integers B,H,N,D, got {args.shape!r}", file=sys.stderr)
            return 2
    if args.tile < 1:
        print(f"{PROG}: --tile must be a positive integer, got {args.tile}", file=sys.stderr)
        return 2
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=140)
    progress = lambda line: console.print(f"[dim]{line}[/dim]")  # noqa: E731
    try:
        from research import lab_inputs

        model_size = args.model_size or ("quick" if args.quick else "cpu")
        if args.model_inputs:
            recorded = lab_inputs.load(args.model_inputs)
        elif model_size != "none":
            recorded = lab_inputs.record_model_inputs(model_size, device=device, seed=args.seed, progress=progress)
        else:
            recorded = []
        result = run_lab(device, shape=shape, seed=args.seed, quick=args.quick, tile=args.tile,
                         model_inputs=recorded, progress=progress)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    result["command"] = " ".join(
        [PROG, f"--device {device}"] + (["--quick"] if args.quick else [])
        + ([f"--shape {args.shape}"] if args.shape else []) + [f"--seed {args.seed}", f"--tile {args.tile}"]
        + ([f"--model-inputs {args.model_inputs}"] if args.model_inputs else [f"--model-size {model_size}"])
        + ([f"--json {args.json}"] if args.json else []))
    render(result, console)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
