"""Instructions per loop iteration of the Triton kernels on Hopper, without a GPU.

    python benchmarks/sass_loop_counts.py [--kernel fwd|dq|dkdv|stats|fwd_hopper|dkdv_hopper]
        [--head-dim 64|128] [--json PATH]

Compiles the forward kernel (plain, fixed), the dQ kernel (statistics off, on, on with the
per-row outputs of AttentionStats.rows_hook), the dK/dV kernel, the observe-mode statistics
kernel and the opt-in Hopper variants of the forward and the dK/dV kernel
(``kernels/hopper.py``: pointer loads, TMA, TMA with warp specialisation) for sm_90 at their
``kernels/tuning.py`` configurations, with the argument specialisation the launcher gets at
the bench's shapes (16-byte aligned pointers, strides and N divisible by 16), disassembles the cubin with the
cuobjdump that ships with Triton, and prints, per compilation, the registers per thread, the
stack (spilled registers live there), the shared memory, and for every loop (a backward branch)
its instruction count and most frequent opcodes. Counting first: a statistic that adds k
instructions per score to an issue-bound loop of n costs about k/n of it, and registers decide
how many programs an SM holds (docs/KERNEL_TUNING.md, "Counting first").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

FP32_POINTERS = {"LSE", "DELTA", "ROWMAX", "ST_E", "ST_EABS", "ST_ESQ", "ST_ETIED", "ST_MAXL", "ERR_ROWS", "PK",
                 "U", "XV", "XO", "UGV", "SKETCH"}
# per kernel: its function in triton_kernels and, per variant, (tuning.TABLE entry, constexprs)
KERNELS = {
    "fwd": ("_attn_fwd_kernel", {"plain": ("fwd", {"FIXED": False, "STATS": False, "INJECT": False}),
                                 "fixed": ("fwd_fixed", {"FIXED": True, "STATS": False, "INJECT": False})}),
    "dq": ("_attn_bwd_dq_kernel", {"plain": ("dq", {"STATS": False, "ROWS": False}),
                                   "stats": ("dq_stats", {"STATS": True, "ROWS": False}),
                                   "rows": ("dq_rows", {"STATS": True, "ROWS": True, "REDUCE": False}),
                                   "reduce": ("dq_rows", {"STATS": True, "ROWS": True, "REDUCE": True, "SKETCH_R": 64})}),
    "dkdv": ("_attn_bwd_dkdv_kernel", {"plain": ("dkdv", {})}),
    "stats": ("_attn_stats_kernel", {"plain": ("stats", {"ROWS": False}), "rows": ("stats_rows", {"ROWS": True, "REDUCE": False}),
                                     "reduce": ("stats_rows", {"ROWS": True, "REDUCE": True, "SKETCH_R": 64})}),
    # the opt-in Hopper variants (kernels/hopper.py): pointer loads, TMA, TMA + warp specialisation
    "fwd_hopper": ("hopper._attn_fwd_hopper_kernel",
                   {"ptr": ("fwd_hopper", {"STATS": False, "TMA": False, "WARP_SPECIALIZE": False}),
                    "tma": ("fwd_hopper", {"STATS": False, "TMA": True, "WARP_SPECIALIZE": False}),
                    "ws": ("fwd_hopper_ws", {"STATS": False, "TMA": True, "WARP_SPECIALIZE": True})}),
    "dkdv_hopper": ("hopper._attn_bwd_dkdv_hopper_kernel",
                    {"ptr": ("dkdv_hopper", {"TMA": False, "WARP_SPECIALIZE": False}),
                     "tma": ("dkdv_hopper", {"TMA": True, "WARP_SPECIALIZE": False}),
                     "ws": ("dkdv_hopper_ws", {"TMA": True, "WARP_SPECIALIZE": True})}),
}
FP32_SCALARS = {"sm_scale", "eps", "eps_raw", "beta", "min_off", "max_off", "inject_factor", "unit_gap"}


def _compile(fn, constexprs: dict, cfg: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    constexprs = {n: v for n, v in constexprs.items() if n in names}  # each kernel takes its own
    first_scalar = names.index("sqb")  # both kernels take their tensors first, then q's strides
    signature, attrs = {}, {}
    for i, n in enumerate(names):
        if n in constexprs:
            signature[n] = "constexpr"
        elif i < first_scalar:
            signature[n] = "*fp32" if n in FP32_POINTERS else ("*i64" if n.startswith("ST_REP") else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in FP32_SCALARS:
            signature[n] = "fp32"
        else:
            signature[n] = "i32"
            if n != "G":  # strides, H and N of the bench's shapes are multiples of 16; G is 1 there
                attrs[(i,)] = [["tt.divisibility", 16]]
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if "maxnreg" in cfg:
        options["maxnreg"] = cfg["maxnreg"]
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def loop_counts(sass: str) -> list[dict]:
    """Each loop (a branch to an earlier address) of a cuobjdump -sass listing: its instruction
    count and opcode histogram (opcode without modifiers, predicates stripped)."""
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = []
    for addr, text in ins:
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in ins if int(m.group(1), 16) <= a <= addr]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            loops.append({"instructions": len(body), "opcodes": dict(ops.most_common())})
    return loops


def analyse(kind: str, variant: str, head_dim: int) -> dict:
    from flashwatch.kernels import hopper, triton_kernels, tuning

    fn_name, variants = KERNELS[kind]
    entry, flags = variants[variant]
    cfg = tuning.TABLE[entry][head_dim]
    module, _, name = fn_name.rpartition(".")
    fn = getattr(hopper if module == "hopper" else triton_kernels, name)
    constexprs = {"HEAD_DIM": head_dim, "CAUSAL": True, "IEEE": False, "UPCAST": False, "EXACT_BF16": False,
                  "FP32_DELTA": False, "STAGES": cfg["num_stages"], **flags, "BLOCK_M": cfg["BLOCK_M"],
                  "BLOCK_N": cfg["BLOCK_N"]}
    compiled = _compile(fn, constexprs, cfg)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True,
                               check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {"kernel": kind, "variant": variant, "head_dim": head_dim, "config": cfg,
            "registers": int(regs.group(1)) if regs else None, "stack_bytes": int(stack.group(1)) if stack else None,
            "shared_bytes": compiled.metadata.shared, "loops": loop_counts(sass)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=tuple(KERNELS), action="append", help="default: all")
    ap.add_argument("--head-dim", type=int, choices=(64, 128), action="append", help="default: both")
    ap.add_argument("--json", metavar="PATH", help="write every number as JSON")
    args = ap.parse_args(argv)
    out = []
    for kind in args.kernel or tuple(KERNELS):
        for d in args.head_dim or (64, 128):
            for variant in KERNELS[kind][1]:
                r = analyse(kind, variant, d)
                out.append(r)
                c = r["config"]
                print(f"{kind} {variant:<6} D={d} {c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']}: "
                      f"{r['registers']} registers, {r['stack_bytes']} B stack, {r['shared_bytes']} B shared")
                for loop in r["loops"]:
                    top = ", ".join(f"{k} {v}" for k, v in list(loop["opcodes"].items())[:8])
                    print(f"    loop: {loop['instructions']} instructions ({top})")
                sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
