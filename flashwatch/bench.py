"""``flashwatch bench``: attention throughput of flashwatch's kernels against torch SDPA.

For each case (a shape, causal or not, bf16 or fp16) it times forward and forward+backward of torch SDPA
flash (FlashAttention-2), torch SDPA cuDNN, and flashwatch plain (statistics off), plain
(statistics on), plain with the statistics and the W^Q-error chain's in-kernel reduction (what a
monitored call of a Monitor's own-kernel layer runs, ``plain_stats_chain``; the chain's per-call
PyTorch work is not in it), fixed and fp32_delta, as medians of CUDA-event timings
(``triton.testing.do_bench``), all in the same run, and prints ratios to SDPA flash. The
kernels of a shape are timed in three interleaved rounds and each number is the median of the
rounds (one round with --quick or --tune); the JSON keeps the spread of the rounds.

By default the cases are the four ``DEFAULT_SHAPES`` (causal, bf16) and the ``EXTRA_CASES``: the
first shape non-causal, and the first shape in fp16. ``--shape``, ``--no-causal`` or ``--dtype``
time only what they name.

Event timing counts the host when a call's Python launch work outlasts the GPU work queued
ahead of it (small shapes: docs/KERNEL_TUNING.md). ``--device-time`` also times each kernel's
forward+backward captured once in a CUDA graph and replayed: GPU time alone, no Python in the
timed region; it adds a second table (device ms, ratio to SDPA flash, overhead vs plain).

TFLOP/s counts causal attention as half the dense 4*B*H*N^2*D forward FLOPs and
forward+backward as 3.5x the forward (FlashAttention-2's convention: the backward does 2.5x the
forward's work).
Needs CUDA; ``--json PATH`` writes every number with the GPU, versions and date.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import sys

import torch

DEFAULT_SHAPES = ((16, 12, 1024, 64), (8, 16, 2048, 64), (4, 32, 4096, 128), (1, 32, 16384, 128))
# beside the default shapes: the first one without the causal mask, and in fp16 (shape, causal, dtype name)
EXTRA_CASES = ((DEFAULT_SHAPES[0], False, "bf16"), (DEFAULT_SHAPES[0], True, "fp16"))
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNELS = ("sdpa_flash", "sdpa_cudnn", "plain", "plain_stats", "plain_stats_chain", "fixed", "fp32_delta")
OVER_PLAIN = ("plain_stats", "plain_stats_chain", "fixed", "fp32_delta")  # the kernels timed against plain


def parse_shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"shape must be four positive integers B,H,N,D (e.g. 16,12,1024,64), got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def attention_flops(shape, causal: bool) -> float:
    B, H, N, D = shape
    return 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


class ReducingHook:
    """A rows hook (``AttentionStats.rows_hook``) that takes the W^Q-error chain's in-kernel
    reduction with random factors of q's shape (B, H, N, D): u (H, D), x.v (B, H, N), x Omega
    (B, N, r); what a monitored call of a layer with the chain makes the kernels do, without the
    chain's per-call PyTorch work (the factors from X)."""

    def __init__(self, q: torch.Tensor, r: int):
        from .kernels.stats import RowReduction

        B, H, N, D = q.shape
        g = torch.Generator(device=q.device).manual_seed(0)
        f32 = dict(device=q.device, dtype=torch.float32)
        self.reduction_ = RowReduction(torch.randn(H, D, generator=g, **f32), torch.randn(B, H, N, generator=g, **f32),
                                       torch.randn(B, N, r, generator=g, **f32), torch.zeros(H, **f32),
                                       torch.zeros(H, D, r, **f32), lambda: None)

    def reduction(self, q):
        return self.reduction_

    def __call__(self, e_rows, pk):
        raise RuntimeError("the kernels stored the rows instead of reducing them (FLASHWATCH_KERNEL_REDUCTION=0?): "
                           "this hook times the reduction")


def _flashwatch(variant: str, with_stats: bool, chain: bool = False):
    """flashwatch's kernel as the bench calls it: ``with_stats``, an ``AttentionStats`` kept across
    calls as a Monitor keeps its layers'; ``chain``, with the W^Q-error chain's reduction too."""
    from flashwatch.kernels import AttentionStats, flash_attention

    held: dict = {}  # per shape: the statistics (and the chain's hook), kept across calls

    def run(q, k, v, causal):
        stats = None
        if with_stats:
            stats = held.get(q.shape)
            if stats is None:
                stats = held[q.shape] = AttentionStats(q.shape[1], q.device)
                if chain:
                    from .chain import SKETCH_DIM

                    stats.rows_hook = ReducingHook(q, SKETCH_DIM)
        return flash_attention(q, k, v, causal=causal, variant=variant, stats=stats)

    return run


def kernel_functions() -> dict:
    from torch.nn.attention import SDPBackend

    return {
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "plain": _flashwatch("plain", False),
        "plain_stats": _flashwatch("plain", True),
        "plain_stats_chain": _flashwatch("plain", True, chain=True),
        "fixed": _flashwatch("fixed", False),
        "fp32_delta": _flashwatch("fp32_delta", False),
    }


def attention_inputs(shape, dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v (requiring grad) and an output gradient g of ``shape`` (B, H, N, D) on CUDA, seeded."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)
               for _ in range(3))
    return q, k, v, torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)


def time_kernel(fn, shape, causal: bool, dtype, warmup_ms=25, rep_ms=100) -> dict:
    """Median forward and forward+backward milliseconds, and peak extra memory of fwd+bwd."""
    import triton.testing

    q, k, v, g = attention_inputs(shape, dtype)

    def fwd():
        with torch.no_grad():
            fn(q, k, v, causal)

    def fwd_bwd():
        out = fn(q, k, v, causal)
        torch.autograd.grad(out, (q, k, v), g)

    fwd_bwd()  # compile / autotune outside the timings
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    t_fwd = triton.testing.do_bench(fwd, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    t_fb = triton.testing.do_bench(fwd_bwd, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return {"fwd_ms": t_fwd, "fwd_bwd_ms": t_fb, "peak_extra_mib": peak / 2**20}


def device_fwd_bwd_ms(fn, shape, causal: bool, dtype, rep_ms=100) -> float:
    """Median milliseconds of one forward+backward replayed from a CUDA graph: the kernels'
    GPU time without the host's launch work. Raises if the call cannot be captured."""
    import triton.testing

    q, k, v, g = attention_inputs(shape, dtype)

    def fwd_bwd():
        return torch.autograd.grad(fn(q, k, v, causal), (q, k, v), g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as graph capture requires
        for _ in range(3):
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd_bwd()
    graph.replay()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median")


def add_ratios(row: dict) -> None:
    """Speed ratios to SDPA flash and overheads vs plain, for the event and (when measured) the
    device timings of one shape's row, in place."""
    ref = row["kernels"].get("sdpa_flash", {})
    for t in row["kernels"].values():
        if "fwd_ms" in t and "fwd_ms" in ref:
            # speed ratio: > 1 means faster than SDPA flash
            t["fwd_speed_vs_sdpa_flash"] = ref["fwd_ms"] / t["fwd_ms"]
            t["fwd_bwd_speed_vs_sdpa_flash"] = ref["fwd_bwd_ms"] / t["fwd_bwd_ms"]
        if "fwd_bwd_device_ms" in t and "fwd_bwd_device_ms" in ref:
            t["fwd_bwd_device_speed_vs_sdpa_flash"] = ref["fwd_bwd_device_ms"] / t["fwd_bwd_device_ms"]
    plain = row["kernels"].get("plain", {})
    for name in OVER_PLAIN:
        t = row["kernels"].get(name, {})
        if "fwd_ms" in t and "fwd_ms" in plain:
            t["fwd_overhead_vs_plain"] = t["fwd_ms"] / plain["fwd_ms"] - 1.0
            t["fwd_bwd_overhead_vs_plain"] = t["fwd_bwd_ms"] / plain["fwd_bwd_ms"] - 1.0
        if "fwd_bwd_device_ms" in t and "fwd_bwd_device_ms" in plain:
            t["fwd_bwd_device_overhead_vs_plain"] = t["fwd_bwd_device_ms"] / plain["fwd_bwd_device_ms"] - 1.0


def sweep_configurations(kind: str, time_ms, base_ms: float) -> tuple[list[dict], dict | None]:
    """Time every candidate of ``tuning.CANDIDATES[kind]`` (each set as the kind's override while
    ``time_ms()`` runs and returns its device ms): per candidate ``{"config", "ms", "over_base"}``
    (``ms / base_ms - 1``), or ``{"config", "error"}`` for one that does not compile or launch, and
    the fastest result (None if none ran)."""
    from .kernels import tuning

    results = []
    for cfg in tuning.CANDIDATES[kind]:
        tuning.set_override(kind, cfg)
        try:
            ms = time_ms()
            results.append({"config": cfg, "ms": ms, "over_base": ms / base_ms - 1.0})
        except Exception as exc:  # a configuration that does not fit (registers, shared memory): reported
            results.append({"config": cfg, "error": f"{type(exc).__name__}: {exc}"[:200]})
        finally:
            tuning.set_override(kind, None)
    timed = [r for r in results if "ms" in r]
    return results, (min(timed, key=lambda r: r["ms"]) if timed else None)


def config_label(cfg: dict) -> str:
    """A kernel configuration (``tuning._cfg``) as "64x32 w4 s3" (with " maxnreg N" where capped)."""
    return f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']} w{cfg['num_warps']} s{cfg['num_stages']}" + (
        f" maxnreg {cfg['maxnreg']}" if "maxnreg" in cfg else "")


def print_sweep(results: list[dict], best: dict | None, table: dict, unit: str = "ms",
                peer_ms: float | None = None) -> None:
    """One line per candidate of ``sweep_configurations``: tiles, time, overhead; the fastest and the
    table's entry marked. With ``peer_ms`` (a peer's time for the same work, e.g. cuDNN's), also
    each candidate's speed against it (> 1: faster)."""
    scale = 1e3 if unit == "us" else 1.0
    for r in results:
        c = r["config"]
        label = config_label(c)
        mark = (" <- best" if r is best else "") + (" (table)" if c == table else "")
        if "ms" in r:
            peer = f"  {peer_ms / r['ms']:.2f}x" if peer_ms is not None else ""
            print(f"  {label:<28} {scale * r['ms']:8.3f} {unit}  {r['over_base']:+7.1%}{peer}{mark}")
        else:
            print(f"  {label:<28} failed: {r['error']}")


def write_sweep_json(path: str | None, rows: list[dict]) -> None:
    """A sweep script's rows, with the environment they were measured in, as JSON at ``path`` (None:
    nothing written)."""
    if path:
        with open(path, "w") as f:
            json.dump({"environment": environment(), "rows": rows}, f, indent=1)


def environment() -> dict:
    import triton

    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def _median_of_rounds(samples: list[dict]) -> dict:
    """Per key, the median over rounds; the spread (max/min - 1) of the forward+backward time too."""
    out = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
    fb = [s["fwd_bwd_ms"] for s in samples]
    out["fwd_bwd_spread"] = max(fb) / min(fb) - 1.0
    out["rounds"] = len(samples)
    return out


def run_bench(shapes=DEFAULT_SHAPES, causal=True, dtype=torch.bfloat16, kernels=KERNELS, rep_ms=100,
              rounds=3, device_time=False, extra_cases=()) -> dict:
    """Time every kernel at every shape (``causal``, ``dtype``), then at each of ``extra_cases``
    ((shape, causal, dtype name) triples). The kernels of a case are timed in turn, ``rounds``
    times over (interleaved, so a slow phase of the GPU touches every kernel alike), and each
    number is the median over the rounds. ``device_time``: also the CUDA-graph replay time of
    forward+backward (``fwd_bwd_device_ms``, once per kernel and case, after the rounds)."""
    cases = [(tuple(s), causal, dtype) for s in shapes] + [(tuple(s), c, DTYPES[d]) for s, c, d in extra_cases]
    fns = kernel_functions()
    results = []
    for shape, causal, dtype in cases:
        flops = attention_flops(shape, causal)
        row = {"shape": list(shape), "causal": causal, "dtype": str(dtype).replace("torch.", ""), "kernels": {}}
        samples: dict[str, list[dict]] = {name: [] for name in kernels}
        errors: dict[str, str] = {}
        for _ in range(rounds):
            for name in kernels:
                if name in errors:
                    continue
                try:
                    samples[name].append(time_kernel(fns[name], shape, causal, dtype, rep_ms=rep_ms))
                except Exception as exc:  # a backend missing on this GPU/torch: say so, go on
                    errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        for name in kernels:
            if name in errors:
                row["kernels"][name] = {"error": errors[name]}
                continue
            t = _median_of_rounds(samples[name])
            t["fwd_tflops"] = flops / t["fwd_ms"] / 1e9
            t["fwd_bwd_tflops"] = 3.5 * flops / t["fwd_bwd_ms"] / 1e9
            if device_time:
                try:
                    t["fwd_bwd_device_ms"] = device_fwd_bwd_ms(fns[name], shape, causal, dtype, rep_ms=rep_ms)
                except Exception as exc:  # a kernel that cannot be captured: say so, keep its event timing
                    t["fwd_bwd_device_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            row["kernels"][name] = t
        add_ratios(row)
        results.append(row)
    return {"environment": environment(), "results": results}


def case_label(row: dict) -> str:
    """B,H,N,D, with "non-causal" and the dtype added where they differ from causal bf16."""
    label = ",".join(map(str, row["shape"]))
    if not row.get("causal", True):
        label += " non-causal"
    if row.get("dtype", "bfloat16") != "bfloat16":
        label += f" {row['dtype']}"
    return label


def print_table(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    env = report["environment"]
    table = Table(title=f"attention throughput, {env['gpu']}, torch {env['torch']}, triton {env['triton']}, "
                        f"{env['date']} (speed ratio > 1: faster than SDPA flash)")
    for col in ("B,H,N,D", "kernel", "fwd ms", "fwd TF/s", "f+b ms", "f+b TF/s", "fwd ×flash", "f+b ×flash",
                "f+b vs plain", "peak MiB"):
        table.add_column(col, justify="right")
    for row in report["results"]:
        for name, t in row["kernels"].items():
            if "error" in t:
                table.add_row(case_label(row), name, "-", "-", "-", "-", "-", "-", "-",
                              t["error"][:30])
                continue
            over = t.get("fwd_bwd_overhead_vs_plain")
            table.add_row(case_label(row), name, f"{t['fwd_ms']:.3f}", f"{t['fwd_tflops']:.0f}",
                          f"{t['fwd_bwd_ms']:.3f}", f"{t['fwd_bwd_tflops']:.0f}",
                          f"{t.get('fwd_speed_vs_sdpa_flash', math.nan):.2f}",
                          f"{t.get('fwd_bwd_speed_vs_sdpa_flash', math.nan):.2f}",
                          "" if over is None else f"{100 * over:+.1f}%", f"{t['peak_extra_mib']:.0f}")
    console.print(table)
    if any("fwd_bwd_device_ms" in t or "fwd_bwd_device_error" in t
           for row in report["results"] for t in row["kernels"].values()):
        print_device_table(report, console)


def print_device_table(report: dict, console=None) -> None:
    """The forward+backward GPU time (CUDA-graph replay) beside the event timing."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title="forward+backward GPU time alone (one call captured in a CUDA graph, replayed)")
    for col in ("B,H,N,D", "kernel", "event ms", "device ms", "device ×flash", "device vs plain"):
        table.add_column(col, justify="right")
    for row in report["results"]:
        for name, t in row["kernels"].items():
            if "error" in t:
                continue
            shape = case_label(row)
            if "fwd_bwd_device_ms" not in t:
                table.add_row(shape, name, f"{t['fwd_bwd_ms']:.3f}", "-", "-", t.get("fwd_bwd_device_error", "")[:30])
                continue
            over = t.get("fwd_bwd_device_overhead_vs_plain")
            table.add_row(shape, name, f"{t['fwd_bwd_ms']:.3f}", f"{t['fwd_bwd_device_ms']:.3f}",
                          f"{t.get('fwd_bwd_device_speed_vs_sdpa_flash', math.nan):.2f}",
                          "" if over is None else f"{100 * over:+.1f}%")
    console.print(table)


def main(args) -> int:
    """Entry point of ``flashwatch bench`` (arguments parsed in flashwatch.cli)."""
    try:  # the arguments first: a wrong one is said as such, GPU or not
        shapes = [parse_shape(s) for s in args.shape] if args.shape else list(DEFAULT_SHAPES)
    except ValueError as exc:
        print(f"flashwatch bench: {exc}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("flashwatch bench needs a CUDA GPU (it compares Triton kernels with torch SDPA on the device); "
              "none is visible here.", file=sys.stderr)
        return 2
    import os

    if args.tune:
        os.environ["FLASHWATCH_AUTOTUNE"] = "1"
    if args.quick:
        shapes = shapes[:2]
    # the extra rows only in the default run: a named shape, mask or dtype times just that
    default_run = not (args.shape or args.no_causal or args.dtype != "bf16" or args.quick or args.tune)
    report = run_bench(shapes, causal=not args.no_causal, dtype=DTYPES[args.dtype], rep_ms=50 if args.quick else 100,
                       rounds=1 if args.quick or args.tune else 3, device_time=args.device_time,
                       extra_cases=EXTRA_CASES if default_run else ())
    if args.tune:
        from flashwatch.kernels import tuning

        report["tuned_configs"] = [{"kind": k[0], "head_dim": k[1], "dtype": str(k[2]), "causal": k[3], "N": k[4],
                                    "config": v} for k, v in tuning._chosen.items()]
    print_table(report)
    if args.tune:
        for item in report["tuned_configs"]:
            print("tuned", item)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0
