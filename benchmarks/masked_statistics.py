"""Observe mode's statistics of a call given its causal mask as a tensor (Hugging Face under
torch.compile): the plain pass the dense pass hands such a mask to, against the dense pass itself.

Prints whether the shortcut's statistics equal the plain pass's (they must: it is the plain pass), the
device time a call of each takes (the shortcut with its mask seen before, and with a new mask each
call, whose pattern it reads once), and a few statistics of both (the dense pass computes in FP32 from
the same BF16 inputs: rows equal, ties and the max logit close).

    python benchmarks/masked_statistics.py                      # GPT-2 small's shape, batch 4
    python benchmarks/masked_statistics.py --device cpu --shape 1,2,64,16   # a smoke test
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from flashwatch.kernels import AttentionStats, attention_statistics, masked


def _timed_ms(fn, heads: int, device: str, reps: int) -> float:
    """Mean time of ``fn(stats)`` (CUDA events on CUDA, the host clock elsewhere)."""
    fn(AttentionStats(heads, device=device))
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn(AttentionStats(heads, device=device))
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps
    import time

    t0 = time.perf_counter()
    for _ in range(reps):
        fn(AttentionStats(heads, device=device))
    return (time.perf_counter() - t0) * 1e3 / reps


def _same_statistics(got: dict, want: dict) -> bool:
    """Counts and maxima equal; the FP32 sums of the delta error equal to 1e-6 of the row terms' size
    (on CUDA the plain pass adds them with atomics, in no fixed order, so two calls differ in the last bits)."""
    terms = max(max(want.get("delta_error_abs", [0.0])), 1e-30)
    for name, values in want.items():
        if not name.startswith("delta_error"):
            if got[name] != values:
                return False
        elif any(abs(a - b) > 1e-6 * max(abs(b), terms if name in ("delta_error", "delta_error_tied") else 0)
                 + 1e-12 for a, b in zip(got[name], values)):
            return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="4,12,1024,64", help="B,H,N,D")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs CUDA (or --device cpu for a smoke test)")
        return 2
    B, H, N, D = (int(x) for x in args.shape.split(","))
    dev, scale = args.device, D ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, N, D, device=dev, generator=g).to(torch.bfloat16) for _ in range(4))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = torch.ones(N, N, dtype=torch.bool, device=dev).tril()

    def with_mask(stats, fresh=False):
        masked.attention_statistics(q, k, v, out, grad, stats, attn_mask=mask.clone() if fresh else mask,
                                    sm_scale=scale)

    def plain(stats):
        attention_statistics(q, k, v, out, grad, stats, causal=True, sm_scale=scale)

    def run(fn):
        stats = AttentionStats(H, device=dev)
        fn(stats)
        return stats.as_dict()

    shortcut, reference = run(with_mask), run(plain)
    result = {"shape": [B, H, N, D], "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "shortcut_equals_plain": _same_statistics(shortcut, reference),
              "plain_ms": _timed_ms(plain, H, dev, args.reps),
              "shortcut_ms": _timed_ms(with_mask, H, dev, args.reps),
              "shortcut_new_mask_ms": _timed_ms(lambda s: with_mask(s, fresh=True), H, dev, args.reps)}
    chosen = masked._plain_equivalent
    masked._plain_equivalent = lambda attn_mask, n, read=None: None  # the dense pass, as before the shortcut
    try:
        dense = run(with_mask)
        result["dense_ms"] = _timed_ms(with_mask, H, dev, max(1, args.reps // 3))
    finally:
        masked._plain_equivalent = chosen
    result["statistics"] = {name: {"shortcut": shortcut[name], "dense": dense[name]}
                            for name in ("rows", "repeated_max_rows", "repeated_max_rows_bf16", "max_logit",
                                         "delta_error_abs")}
    print(f"B,H,N,D {B},{H},{N},{D} bf16, {result['device']}, torch {torch.__version__}")
    print(f"shortcut equals the plain pass (FP32 sums to 1e-6): {result['shortcut_equals_plain']}")
    print(f"ms a call: plain {result['plain_ms']:.3f}, shortcut {result['shortcut_ms']:.3f} (a new mask each call "
          f"{result['shortcut_new_mask_ms']:.3f}), dense {result['dense_ms']:.3f}")
    for name, both in result["statistics"].items():
        print(f"{name:24s} shortcut {[round(x, 4) for x in both['shortcut'][:3]]}  "
              f"dense {[round(x, 4) for x in both['dense'][:3]]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
