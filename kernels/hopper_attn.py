"""Launchers of the opt-in Hopper variants (``hopper``): the forward and the dK/dV kernel.

``triton_attn``'s launchers call ``launch_fwd`` / ``launch_dkdv`` first; each returns False,
launching nothing, unless ``tuning.hopper_features`` names its kernel (FLASHWATCH_HOPPER or
``tuning.set_hopper``; off by default) and the call is one the variant covers (the forward: the
plain and fp32_delta variants without an injected fault). TMA is used only where the hardware
allows it: on CUDA devices of compute capability 9 or more (and under the interpreter), with
16-byte aligned head bases and row strides; otherwise the variant reads through pointers.
Block shapes come from the variants' own ``tuning`` entries (``tuning.hopper_entry``); with
FLASHWATCH_AUTOTUNE=1 their ``tuning.CANDIDATES`` are timed like the plain kernels'.
"""

from __future__ import annotations

import torch
import triton

from . import hopper, tuning


def _allocate(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side TMA descriptors need a small global scratch buffer per program; Triton asks
    its allocator for it at launch. Set one only where none is set in this thread's context."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_allocate)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA descriptors of each tensor's heads are valid: a (B, heads, N, D) tensor with
    a unit last stride, its base and every other stride a multiple of 16 bytes."""
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
            return False
    return True


def _features(kernel: str, q: torch.Tensor, *tensors: torch.Tensor):
    """(features, TMA on) for this call, or None: the plain kernel runs."""
    features = tuning.hopper_features(kernel)
    if features is None:
        return None
    hardware = q.device.type == "cpu" or torch.cuda.get_device_capability(q.device)[0] >= 9
    tma = "tma" in features and hardware and tma_ok(q, *tensors)
    if not tma:
        features = features - {"tma", "ws"}  # warp specialisation needs the TMA loads (tuning.parse_hopper)
    if tma and q.device.type == "cuda":
        _ensure_allocator()
    return features, tma


def _fwd(q, k, v, o, lse, r, rowmax, maxlogit, causal, sm_scale, fp32_delta, stats_on, upcast, exact, features, tma,
         cfg):
    B, H, N, D = q.shape
    strides = [s for t in (q, k, v, o) for s in t.stride()[:3]]
    hopper._attn_fwd_hopper_kernel[(triton.cdiv(N, cfg["BLOCK_M"]), B * H)](
        q, k, v, o, lse, r, rowmax, maxlogit, *strides, H, H // k.shape[1], N, sm_scale,
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal, FP32_DELTA=fp32_delta,
        STATS=stats_on, IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact, TMA=tma,
        STAGES=cfg["num_stages"], WARP_SPECIALIZE="ws" in features, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])


def launch_fwd(q, k, v, o, lse, r, rowmax, maxlogit, causal, sm_scale, variant, stats_on, inject_factor,
               upcast, exact) -> bool:
    """Run the Hopper forward if it is asked for and covers the call; True if it ran.
    Arguments as ``triton_attn._launch_fwd``'s; upcast, exact: its interpreter workarounds."""
    if variant == "fixed" or inject_factor != 1.0:
        return False
    chosen = _features("fwd", q, k, v, o, r)
    if chosen is None:
        return False
    features, tma = chosen

    def bench(cfg):  # FLASHWATCH_AUTOTUNE=1: statistics off, into scratch outputs
        so, slse = torch.empty_like(o), torch.empty_like(lse)
        return lambda: _fwd(q, k, v, so, slse, so, slse, slse, causal, sm_scale, False, False, upcast, exact,
                            features, tma, cfg)

    cfg = tuning.choose(tuning.hopper_entry("fwd", features), q, causal, bench)
    _fwd(q, k, v, o, lse, r, rowmax, maxlogit, causal, sm_scale, variant == "fp32_delta", stats_on, upcast, exact,
         features, tma, cfg)
    return True


def _dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, upcast, exact, features, tma, cfg):
    B, H, N, D = q.shape
    Hkv = k.shape[1]
    strides = [s for t in (q, k, v, do) for s in t.stride()[:3]]
    hopper._attn_bwd_dkdv_hopper_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, *strides, H, H // Hkv, N, sm_scale,
        HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], CAUSAL=causal,
        IEEE=q.dtype == torch.float32, UPCAST=upcast, EXACT_BF16=exact, TMA=tma, STAGES=cfg["num_stages"],
        WARP_SPECIALIZE="ws" in features, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def launch_dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, upcast, exact) -> bool:
    """Run the Hopper dK/dV kernel if it is asked for; True if it ran. Arguments as
    ``triton_attn._launch_dkdv``'s; upcast, exact: its interpreter workarounds."""
    chosen = _features("dkdv", q, k, v, do, dk, dv)
    if chosen is None:
        return False
    features, tma = chosen

    def bench(cfg):  # FLASHWATCH_AUTOTUNE=1: into scratch gradients
        sk, sv = torch.empty_like(dk), torch.empty_like(dv)
        return lambda: _dkdv(q, k, v, do, lse, delta, sk, sv, causal, sm_scale, upcast, exact, features, tma, cfg)

    cfg = tuning.choose(tuning.hopper_entry("dkdv", features), q, causal, bench)
    _dkdv(q, k, v, do, lse, delta, dk, dv, causal, sm_scale, upcast, exact, features, tma, cfg)
    return True
