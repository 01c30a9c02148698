"""The bias lab's low-precision rows: P_bar (and V) in FP8 E4M3, FP8 E5M2 and MXFP4 for the P_bar V product.

``format_kernels()`` gives the lab (``research.lab``) one kernel per format x variant of
``research.format_attention``; ``format_table(result)`` gathers their delta errors from a lab
result, one row per format x variant (the JSON's ``formats``; docs/LAB.md).
"""

from __future__ import annotations

from research.lab import Kernel

__all__ = ["LAB_FORMATS", "format_kernels", "format_table"]

LAB_FORMATS = ("fp8_e4m3", "fp8_e5m2", "mxfp4")


def format_kernels(formats=LAB_FORMATS) -> list[Kernel]:
    """P_bar and V rounded to each format for the P_bar V product, FP32 accumulation, BF16 output,
    for the plain, fixed, fp32_delta and rounded_sum variants (``research.format_attention``);
    and, per format, plain and rounded_sum with P_bar alone rounded (V in BF16). Each kernel's
    ``run`` returns (O, the output its backward takes delta from)."""
    from research.format_attention import FORMAT_VARIANTS, format_forward

    def run(q, k, v, fmt, variant, round_v=True):
        f = format_forward(q, k, v, fmt=fmt, variant=variant, round_v=round_v)
        if variant != "fp32_delta":
            return f["out"], f["out"]
        o32 = f["out"].to(f["o_fp32"].dtype)  # O + R, R = O_fp32 - O in BF16, as the backward uses it
        return f["out"], o32 + (f["o_fp32"] - o32).to(q.dtype)

    stored = "rowsum(dO*O) of its stored BF16 output"
    sources = {"plain": stored, "fixed": stored, "rounded_sum": stored,
               "fp32_delta": "rowsum(dO*(O+R)): the FP32 output kept by the forward"}
    return [Kernel(f"{fmt}_{variant}", f"P_bar and V in {fmt} for P_bar V, FP32 accumulation, variant={variant} "
                                       "(research.format_attention)",
                   lambda q, k, v, fmt=fmt, variant=variant: run(q, k, v, fmt, variant), sources[variant], fmt=fmt)
            for fmt in formats for variant in FORMAT_VARIANTS] + [
        Kernel(f"{fmt}_{variant}_pbar_only", f"P_bar alone in {fmt} (V in BF16), FP32 accumulation, "
                                             f"variant={variant}: the part of the bias that rounding P_bar makes",
               lambda q, k, v, fmt=fmt, variant=variant: run(q, k, v, fmt, variant, round_v=False), sources[variant],
               fmt=fmt)
        for fmt in formats for variant in ("plain", "rounded_sum")]


def format_table(result: dict) -> list[dict]:
    """One row per low-precision format x variant: the delta its backward uses, per input set.

    Each row: {"kernel", "format", "variant", <input name>: {"z_tie", "z_other", "z_all", "z_heads",
    "mean_abs", "o_mean_abs"}}; z of delta_used - delta_exact (float64) on tie rows, other rows, all
    rows, and on all rows with (batch, head) pairs as the units (``row_stats``).
    """
    rows = []
    for kname, kinfo in result["kernels"].items():
        if not kinfo.get("format"):
            continue
        row = {"kernel": kname, "format": kinfo["format"], "variant": kname[len(kinfo["format"]) + 1:]}
        for iname, entry in result["inputs"].items():
            r = entry["results"].get(kname, {})
            if "delta_used" not in r:
                continue
            d = r["delta_used"]
            row[iname] = {"z_tie": d["tie"]["z"], "z_other": d["other"]["z"], "z_all": d["all"]["z"],
                          "z_heads": d["all"]["z_heads"], "mean_abs": d["all"]["mean_abs"],
                          "o_mean_abs": r["out"]["all"]["mean_abs"]}
        rows.append(row)
    return rows
