"""The W^Q-error chain's step-end reading as one launch, where PyTorch takes about sixty.

``read_chains`` computes what ``flashwatch.chain.LayerChain.read_all`` computes with PyTorch
operations (the reference: the CPU path and the tests' oracle) for L chains of one shape whose
state is held stacked, one program a (chain, head):

- the readings, float64: push = -ugv, push_true, the alignment of this step's sketch g with the
  previous one (g . prev / (|g| |prev|)) and the window's coherence (|ew_sum| / ew_norm after
  this step's update); NaN where the step fed no rows (push, alignment, coherence), no gradient
  (push_true), or the quantity is not defined yet;
- the window's update in place: ew_sum <- lam ew_sum + g, ew_norm <- lam ew_norm + |g|,
  prev <- g, has_prev <- True, where the step fed rows;
- the next step's accumulators set to zero: ugv, push_true, the sketch.

Norms and the dot product are FP32 sums of D r products (as the reference's reductions, in
another order), taken to float64 as there; the results agree with it to FP32 rounding. Every run
gives the same bits (each output written by one program, no atomics).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .launch import launch, on_device

__all__ = ["read_chains"]

_BLOCK = 4096  # sketch entries a program takes at once (GPT-2 small's D r = 64 x 64: all of them)


@triton.jit
def _read_chains_kernel(SKETCH, PREV, EW_SUM, EW_NORM, HAS_PREV, UGV, PUSH, ROWS_SEEN, GRAD_SEEN, OUT,
                        H, W, lam_bits, BLOCK: tl.constexpr):
    # grid (L * H,): program p = l * H + h. SKETCH, PREV, EW_SUM (L * H, W) FP32; EW_NORM, PUSH (L * H,)
    # float64; HAS_PREV (L * H,) bool; UGV (L * H,) FP32; ROWS_SEEN, GRAD_SEEN (L,) bool; OUT (L, 4, H)
    # float64. lam_bits: lam's float64 bits (a float argument would be FP32).
    p = tl.program_id(0)
    l = p // H
    h = p % H
    rows = tl.load(ROWS_SEEN + l) != 0
    grads = tl.load(GRAD_SEEN + l) != 0
    lam = lam_bits.to(tl.float64, bitcast=True)
    lam32 = lam.to(tl.float32)  # as PyTorch multiplies an FP32 tensor by a Python float
    base = p.to(tl.int64) * W
    gg = tl.zeros([BLOCK], dtype=tl.float32)
    gp = tl.zeros([BLOCK], dtype=tl.float32)
    pp = tl.zeros([BLOCK], dtype=tl.float32)
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    for w0 in range(0, W, BLOCK):
        i = w0 + tl.arange(0, BLOCK)
        ok = i < W
        g = tl.load(SKETCH + base + i, mask=ok, other=0.0)
        prev = tl.load(PREV + base + i, mask=ok, other=0.0)
        s = tl.load(EW_SUM + base + i, mask=ok, other=0.0)
        gg += g * g
        gp += g * prev
        pp += prev * prev
        s = tl.where(rows, lam32 * s + g, s)
        ss += s * s
        tl.store(EW_SUM + base + i, s, mask=ok)
        tl.store(PREV + base + i, tl.where(rows, g, prev), mask=ok)
        tl.store(SKETCH + base + i, tl.zeros([BLOCK], dtype=tl.float32), mask=ok)
    norm = tl.sqrt(tl.sum(gg, axis=0)).to(tl.float64)
    dot = tl.sum(gp, axis=0).to(tl.float64)
    den = norm * tl.sqrt(tl.sum(pp, axis=0)).to(tl.float64)
    has_prev = tl.load(HAS_PREV + p) != 0
    nan = float("nan")
    alignment = tl.where(rows & has_prev & (den > 0), dot / tl.maximum(den, 1e-300), nan)
    ew_norm = tl.load(EW_NORM + p)
    earlier = ew_norm > 0  # an earlier step added a non-zero error to the window
    ew_norm = tl.where(rows, lam * ew_norm + norm, ew_norm)
    s_norm = tl.sqrt(tl.sum(ss, axis=0)).to(tl.float64)
    coherence = tl.where(rows & earlier & (norm > 0), s_norm / tl.maximum(ew_norm, 1e-300), nan)
    out = OUT + l.to(tl.int64) * 4 * H + h
    tl.store(out, tl.where(rows, -(tl.load(UGV + p).to(tl.float64)), nan))
    tl.store(out + H, tl.where(grads, tl.load(PUSH + p), nan))
    tl.store(out + 2 * H, alignment)
    tl.store(out + 3 * H, coherence)
    tl.store(EW_NORM + p, ew_norm)
    tl.store(HAS_PREV + p, has_prev | rows)
    tl.store(UGV + p, 0.0)
    tl.store(PUSH + p, 0.0)


def read_chains(state: dict[str, torch.Tensor], rows_seen: torch.Tensor, grad_seen: torch.Tensor,
                lam: float) -> torch.Tensor:
    """The readings of L stacked chains, (L, 4, H) float64, their window state updated in place and
    their accumulators zeroed (see the module docstring).

    Args:
        state: the stacked tensors, contiguous on one device: ``sketch``, ``prev``, ``ew_sum`` (L, H,
            D, r) FP32; ``ew_norm``, ``push_true`` (L, H) float64; ``has_prev`` (L, H) bool; ``ugv``
            (L, H) FP32.
        rows_seen, grad_seen: (L,) or (L, 1) bool, whether the step fed each chain rows / a gradient.
        lam: the window's decay, 1 - 1 / window.
    """
    sketch = state["sketch"]
    L, H = sketch.shape[:2]
    W = sketch[0, 0].numel()
    for name, t in state.items():
        if not t.is_contiguous() or t.device != sketch.device or tuple(t.shape[:2]) != (L, H):
            raise ValueError(f"read_chains: {name} must be a contiguous ({L}, {H}, ...) tensor on {sketch.device}, "
                             f"got {tuple(t.shape)} on {t.device}")
    out = torch.empty((L, 4, H), dtype=torch.float64, device=sketch.device)
    lam_bits = struct.unpack("<q", struct.pack("<d", float(lam)))[0]
    with on_device(sketch):  # Monitor.step may run with another device current than the model's
        launch(_read_chains_kernel, (L * H,),
               (sketch, state["prev"], state["ew_sum"], state["ew_norm"], state["has_prev"], state["ugv"],
                state["push_true"], rows_seen.contiguous(), grad_seen.contiguous(), out, H, W, lam_bits),
               dict(BLOCK=min(_BLOCK, triton.next_power_of_2(W)), num_warps=4))
    return out
