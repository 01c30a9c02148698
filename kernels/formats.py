"""Low-precision number formats of the P_bar V product: exact rounding, and where P_bar rounds to 1.

An attention kernel rounds P_bar = exp(s - m) (and, in FP8 kernels, V) to a short format for
the P_bar V matrix product and accumulates in FP32. This module rounds a tensor exactly as such
a kernel would, so that the bias of the repeated maximum (two or more keys with P_bar exactly 1)
can be measured at each precision, and says at which scores P_bar rounds to exactly 1.

Formats (``FORMATS``):

- ``bf16``: 8 significant bits; torch's ``bfloat16`` cast (round to nearest, ties to even).
- ``fp8_e4m3``: OCP FP8 E4M3 ("fn": no infinities, one NaN pattern), 4 significant bits,
  largest finite 448, smallest normal 2**-6, smallest subnormal 2**-9; torch's
  ``float8_e4m3fn`` cast (round to nearest even, subnormals kept).
- ``fp8_e5m2``: OCP FP8 E5M2, 3 significant bits, largest finite 57344, smallest normal
  2**-14, smallest subnormal 2**-16; torch's ``float8_e5m2`` cast.
- ``mxfp4``: OCP Microscaling MXFP4: blocks of 32 consecutive elements along the reduction
  dimension share one E8M0 scale X = 2**(floor(log2(amax)) - 2) (amax: the block's largest
  magnitude; 2 is the largest exponent of E2M1), clamped to the E8M0 range 2**-127..2**127
  (a block of zeros gets X = 1); each element is x / X rounded to FP4 E2M1, magnitudes
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}, to nearest with ties to even, and clamped to +-6 (as the OCP
  MX specification v1.0 says: since amax / X lies in [4, 8), a block's largest element clamps
  to 6 whenever amax / X > 6, i.e. its mantissa is above 1.5). The value is X times the element.

Overflow: every format here saturates (magnitudes beyond the largest finite value become it, as
FP8 kernels convert with ``satfinite``); NaN stays NaN. torch's own FP8 casts need not saturate
(E5M2 gives inf beyond 61440; E4M3's overflow has differed between versions), hence the clamp
before the cast.

Where P_bar rounds to 1 (``unit_threshold``): in an element format of p significant bits the
spacing just below 1 is 2**-p, so values from the midpoint 1 - 2**-(p + 1) up round to 1 (the
midpoint itself too: 1 is the even neighbour). In MXFP4 this holds in the block that holds a
P_bar of exactly 1 (X = 1/4, elements 4 * P_bar, 3.5 rounds to 4): P_bar >= 0.875. A P_bar below
1 in a block without a 1 is never rounded to 1 (with amax in [0.5, 1), X = 1/8 and the largest
value becomes at most 6 X = 0.75), so ``unit_threshold`` is exact for ties within one 32-key block
and counts more than the kernel sees for ties across blocks.

Example::

    from flashwatch.kernels.formats import round_to_format
    p8 = round_to_format(p_bar, "fp8_e4m3")          # same dtype as p_bar, values on the E4M3 grid
    p4 = round_to_format(p_bar, "mxfp4", dim=-1)     # 32-element blocks along the key dimension
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# absolute, as kernels.checks: a checkout's root on sys.path may import this folder as `kernels`
from flashwatch.vocabulary import FORMATS as VOCABULARY_FORMATS

__all__ = ["FORMATS", "Format", "get_format", "round_to_format", "round_to_grid", "mx_block_scale",
           "unit_threshold", "unit_gap", "E2M1_VALUES", "MX_BLOCK"]

MX_BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127


@dataclass(frozen=True)
class Format:
    """One number format: its grid and how the kernel emulation rounds to it.

    Attributes:
        name: the format's name (one of ``FORMATS``).
        mantissa_bits: explicit mantissa bits (significant bits - 1).
        min_exp: exponent of the smallest normal number (subnormals below it share its spacing).
        max_value: largest finite magnitude (values beyond saturate to it).
        torch_dtype: the torch dtype whose cast rounds to this grid, or None (MXFP4 elements).
        block: elements sharing one scale along the reduction dimension (MXFP4), or None.
        fixed_min_offset, fixed_max_offset: the range of the shift the ``fixed`` variant adds on
            repeated-max rows at this format (P_bar's largest value exp(-offset) must round below
            1: offset > -ln(unit_threshold); and stay well inside the format's normal range).
    """

    name: str
    mantissa_bits: int
    min_exp: int
    max_value: float
    torch_dtype: torch.dtype | None
    block: int | None
    fixed_min_offset: float
    fixed_max_offset: float

    @property
    def precision_bits(self) -> int:
        return self.mantissa_bits + 1


# fixed offsets: min = twice the unit gap (1/64 for BF16, as kernels.checks), max keeps exp(-offset)
# two binades above the smallest normal of FP8 E4M3 (2**-6 = exp(-4.2)); E5M2 and MXFP4 have range.
_FORMATS = (
    Format("bf16", 7, -126, float(torch.finfo(torch.bfloat16).max), torch.bfloat16, None, 1.0 / 64.0, 20.0),
    Format("fp8_e4m3", 3, -6, 448.0, torch.float8_e4m3fn, None, 1.0 / 16.0, 2.0),
    Format("fp8_e5m2", 2, -14, 57344.0, torch.float8_e5m2, None, 1.0 / 8.0, 8.0),
    Format("mxfp4", 1, 0, 6.0, None, MX_BLOCK, 0.25, 20.0),
)
FORMATS = VOCABULARY_FORMATS
if tuple(f.name for f in _FORMATS) != FORMATS:  # one list of names: flashwatch.vocabulary's
    raise ImportError(f"kernels.formats defines {[f.name for f in _FORMATS]}, the vocabulary {FORMATS}")
_BY_NAME = {f.name: f for f in _FORMATS}


def get_format(fmt: str | Format) -> Format:
    """The ``Format`` of a name in ``FORMATS`` (a ``Format`` is returned as is)."""
    if isinstance(fmt, Format):
        return fmt
    try:
        return _BY_NAME[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"unknown number format {fmt!r}; accepted: {', '.join(FORMATS)}") from None


def round_to_grid(x: torch.Tensor, mantissa_bits: int, min_exp: int, max_value: float) -> torch.Tensor:
    """x rounded to a binary floating-point grid, nearest with ties to even, saturating; x's dtype.

    The grid: 0, subnormals k * 2**(min_exp - mantissa_bits), and normals with ``mantissa_bits``
    explicit bits from 2**min_exp up to ``max_value``. Exact for float32/float64 inputs whose
    results are representable in them (every division and product here is by a power of two).
    """
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    mag = x.abs()
    _, e = torch.frexp(mag)  # mag = f * 2**e, f in [0.5, 1): floor(log2(mag)) = e - 1
    exp = torch.clamp(e - 1, min=min_exp)
    spacing = torch.ldexp(torch.ones_like(x), (exp - mantissa_bits).to(torch.int32))
    q = torch.round(x / spacing) * spacing  # torch.round: halves to even
    return torch.where(torch.isnan(x), x, q.clamp(-max_value, max_value))


def _move_block_dim(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    dim = dim % x.dim()
    return x.movedim(dim, -1), dim


def mx_block_scale(x: torch.Tensor, dim: int = -1, block: int = MX_BLOCK) -> torch.Tensor:
    """The E8M0 shared scale of each ``block`` consecutive elements of x along ``dim``.

    Returns a tensor of x's shape and dtype holding each element's block scale
    X = 2**clamp(floor(log2(amax)) - 2, -127, 127) (1 for an all-zero block, NaN for a block
    holding NaN or inf). The last block may be shorter than ``block`` (a partial block).
    """
    xt, dim = _move_block_dim(x, dim)
    n = xt.shape[-1]
    pad = (-n) % block
    amax = torch.nn.functional.pad(xt.abs(), (0, pad)).unflatten(-1, (-1, block)).amax(-1)  # (..., nblocks)
    _, e = torch.frexp(amax)
    exp = torch.clamp(e - 1 - 2, _E8M0_MIN_EXP, _E8M0_MAX_EXP)
    scale = torch.ldexp(torch.ones_like(amax), exp.to(torch.int32))
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
    return scale.repeat_interleave(block, dim=-1)[..., :n].movedim(-1, dim)


def round_to_format(x: torch.Tensor, fmt: str | Format, dim: int = -1) -> torch.Tensor:
    """x rounded to ``fmt`` (see the module docstring), returned in x's dtype.

    ``dim`` is the reduction dimension of the matrix product the operand feeds (MXFP4's blocks
    run along it: the key dimension of P_bar, the key dimension of V); the element formats
    ignore it. Exact for float32 and float64 x (float64 is rounded on the grid directly:
    torch's casts from float64 round to float32 first, which can move a value onto a tie).
    """
    f = get_format(fmt)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if f.block is not None:
        scale = mx_block_scale(x, dim, f.block)
        return round_to_grid(x / scale, f.mantissa_bits, f.min_exp, f.max_value) * scale
    if x.dtype == torch.float64:  # torch casts float64 through float32: rounding twice can break ties
        return round_to_grid(x, f.mantissa_bits, f.min_exp, f.max_value)
    sat = x.clamp(-f.max_value, f.max_value)  # keeps NaN; inf -> max (satfinite)
    return sat.to(f.torch_dtype).to(x.dtype)


def unit_threshold(fmt: str | Format) -> float:
    """The smallest P_bar that rounds to exactly 1 in ``fmt``: 1 - 2**-(p + 1), p significant bits.

    0.998046875 for BF16, 0.96875 for FP8 E4M3, 0.9375 for FP8 E5M2, 0.875 for MXFP4 (in the
    block of a P_bar of 1; see the module docstring).
    """
    return 1.0 - 2.0 ** -(get_format(fmt).precision_bits + 1)


def unit_gap(fmt: str | Format) -> float:
    """ln(unit_threshold(fmt)) (negative): P_bar = exp(s - m) rounds to 1 iff s - m >= this."""
    return math.log(unit_threshold(fmt))
