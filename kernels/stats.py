"""AttentionStats: per-head statistics that the attention kernels add into, on the device.

One ``AttentionStats`` belongs to one attention layer. Pass it as ``stats=`` to
``flash_attention`` (or ``attention_statistics``) on a monitored step: the forward adds the
max logit; the backward adds the rows, the repeated-max counts and the signed delta-error sums
(the kernel's dQ pass sees whole rows, so counting there costs no extra pass; a forward
without backward, e.g. under ``torch.no_grad``, adds the max logit only). Nothing
is read back to the host here; the Monitor reads every layer's statistics once per monitored
step (``packed()``), and ``reset()`` zeroes them for the next one. Micro-batches of one
optimizer step simply add up.

Definitions (all sums run over batch and rows, per query head):

- ``rows``: softmax rows seen (int64).
- ``repeated_max_rows``: rows whose maximum score m is reached within ``eps`` by at least two
  keys, i.e. the second largest score s_(2) >= m - eps (exact over the whole row).
- ``repeated_max_rows_bf16``: the same on scores rounded to BF16 (round-to-nearest-even).
- ``repeated_max_rows_format``: rows where P_bar = exp(s - m) rounds to exactly 1 at two or
  more keys in the number format of the P_bar V product (``format``: ``bf16``, ``fp8_e4m3``,
  ``fp8_e5m2``, ``mxfp4``; ``kernels.formats``), i.e. s_(2) >= m + ln(t) with t the smallest
  value that rounds to 1 there (s_(2) >= m - 0.0020 for BF16, m - 0.032 for FP8 E4M3, m - 0.065
  for FP8 E5M2, m - 0.134 for MXFP4, exact for ties within one 32-key block): the rows whose
  P_bar V adds V values exactly, the ties of the paper's mechanism at that precision.
- ``max_logit``: the largest scaled score sm_scale * q.k (-inf until a row was seen).
- ``delta_error``: sum of (delta_used - delta_hp), where delta_used = rowsum(dO * O) is the
  delta the backward actually uses and delta_hp = rowsum(P * dP) = dO . (P V) is the delta of
  the exact softmax output computed in FP32 from the same inputs.
- ``delta_error_abs``, ``delta_error_sq``: sums of |delta_used - delta_hp| and its square.
- ``delta_error_tied``: the part of ``delta_error`` from repeated-max rows.

Per-row outputs (``AttentionStats.rows_hook``): the paper's W^Q-gradient error is, per
attention call, dQ_used - dQ_hp = -sm_scale * (delta_used - delta_hp)[..., None] * (P K), with
P = softmax(sm_scale * q k^T + mask) the exact softmax of the FP32 scores. A hook set on the
statistics receives the two per-row factors of it on the device; or, where the hook offers a
``RowReduction`` and the Triton kernels run, the kernels reduce the rows in their epilogue
(into the W^Q-error chain's per-head sums, ``flashwatch.chain``) and no per-row tensor is
written. The PyTorch paths (CPU reference, masked statistics) always call the hook.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .formats import get_format, unit_gap

RowsHook = Callable[[torch.Tensor, torch.Tensor], object]


class RowReduction(NamedTuple):
    """One call's factors for reducing its W^Q-gradient error rows inside the Triton kernels.

    With c = -sm_scale * delta_error_rows and pk as in ``AttentionStats`` (rows_hook), the
    kernel adds, per query head h:

    - ``ugv[h] += sum_rows c (pk . u[h]) xv[:, h]``  (u_h^T dG_h v_h for the call's dG_h);
    - ``sketch[h] += sum_rows c pk^T xo``  ((D, r): dG_h Omega).

    Fields (FP32, on q's device): ``u`` (H, D), ``xv`` (B, H, N), ``xo`` (B, N, r) with r a
    power of two >= 16, ``ugv`` (H,) and ``sketch`` (H, D, r) added into in place (each
    program's share is summed after the launch, ``rows.RowOutputs``); ``done()`` is called once
    the kernel was launched. ``u``, ``ugv`` and ``sketch`` are contiguous. ``xv`` and ``xo`` are
    contiguous, or both read in place from rows of one (width, B * N) product, the transpose of
    x [v | Omega] (``xv`` with strides (N, B N, 1), ``xo`` with strides (N, 1, B N)); then ``xv_lo``
    (optional, None: none) is a second term of x . v_h, a view of the product like ``xv`` further
    along it, added to it (the chain's split product: ``flashwatch.chain._Factor``).
    """

    u: torch.Tensor
    xv: torch.Tensor
    xo: torch.Tensor
    ugv: torch.Tensor
    sketch: torch.Tensor
    done: Callable[[], object]
    xv_lo: Optional[torch.Tensor] = None

    def check(self, q: torch.Tensor) -> dict:
        """Raise ValueError unless the factors fit q (B, H, N, D); returns their ``layout()``."""
        B, H, N, D = q.shape
        r = self.xo.shape[-1] if self.xo.dim() == 3 else -1
        want = {"u": (H, D), "xv": (B, H, N), "xo": (B, N, r), "ugv": (H,), "sketch": (H, D, r)}
        for name, shape in want.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != torch.float32 or t.device != q.device or (
                    name not in ("xv", "xo") and not t.is_contiguous()):
                raise ValueError(f"RowReduction.{name}: expected a{' contiguous' if name not in ('xv', 'xo') else ''} "
                                 f"float32 tensor of shape {shape} on {q.device}, got {tuple(t.shape)} {t.dtype} on "
                                 f"{t.device}")
        if r < 16 or r & (r - 1):
            raise ValueError(f"RowReduction.xo: sketch width must be a power of two >= 16, got {r}")
        return self.layout()

    def layout(self) -> dict:
        """The kernels' constexprs for reading ``xv`` and ``xo``: X_STRIDE (0: both contiguous, -1: rows
        of one (width, B * N) product) and XV_LO (the low term's row offset from ``xv``, 0: none);
        ValueError for any other layout."""
        xv, xo, lo = self.xv, self.xo, self.xv_lo
        if lo is None and xv.is_contiguous() and xo.is_contiguous():
            return dict(X_STRIDE=0, XV_LO=0)
        B, N, r = xo.shape
        if not (_strides_fit(xo, (N, 1, B * N)) and _strides_fit(xv, (N, B * N, 1))):
            raise ValueError(f"RowReduction: xv {tuple(xv.shape)} strides {xv.stride()} and xo {tuple(xo.shape)} "
                             f"strides {xo.stride()} are neither contiguous nor rows of one (width, B * N) product "
                             f"(xv strides (N, B N, 1), xo strides (N, 1, B N))")
        return dict(X_STRIDE=-1, XV_LO=self._lo_offset(B * N))

    def _lo_offset(self, row: int) -> int:
        """``xv_lo``'s offset from ``xv`` in rows of ``row`` elements of the product (0 without it)."""
        xv, lo = self.xv, self.xv_lo
        if lo is None:
            return 0
        offset = lo.data_ptr() - xv.data_ptr()
        n = offset // lo.element_size() // row if offset > 0 and offset % (lo.element_size() * row) == 0 else 0
        if (lo.shape != xv.shape or lo.dtype != xv.dtype or lo.device != xv.device
                or not _strides_fit(lo, xv.stride()) or n <= 0):
            raise ValueError("RowReduction.xv_lo: expected a view of xv's product with xv's shape and strides, "
                             f"further along it; got {tuple(lo.shape)} strides {lo.stride()} at {offset} bytes from xv")
        return n


def _strides_fit(t: torch.Tensor, strides: tuple) -> bool:
    """Whether t has these strides in every dimension of more than one element."""
    return all(n == 1 or st == want for n, st, want in zip(t.shape, t.stride(), strides))


COUNT_FIELDS = ("rows", "repeated_max_rows", "repeated_max_rows_bf16", "repeated_max_rows_format")
SUM_FIELDS = ("delta_error", "delta_error_abs", "delta_error_sq", "delta_error_tied")
# the power of the output gradient dO each sum is homogeneous in: a loss scaled by S scales it by S**power
# (``flashwatch.loss_scale`` divides it back); the counts and the max logit do not depend on dO
GRADIENT_POWER = {"delta_error": 1, "delta_error_abs": 1, "delta_error_sq": 2, "delta_error_tied": 1}
MAX_FIELDS = ("max_logit",)
FIELDS = COUNT_FIELDS + MAX_FIELDS + SUM_FIELDS


class AttentionStats:
    """Per-head statistics of one attention layer, accumulated on the device.

    Args:
        num_heads: number of query heads H of the layer (statistics are per query head).
        device: where the tensors live; must be the device of the attention inputs.
        format: the number format of the P_bar V product, for ``repeated_max_rows_format``: one
            of ``kernels.formats.FORMATS`` (default ``"bf16"``).

    Attributes: one tensor of shape (num_heads,) per field of ``FIELDS``: int64 counts,
    float32 ``max_logit`` (starts at -inf) and float32 delta-error sums; and ``rows_hook``.

    ``rows_hook`` (default None): a callable ``hook(delta_error_rows, pk)`` or None. While it is
    set, every attention call that adds into these statistics also computes, on q's device:

    - ``delta_error_rows``: (B, H, N) float32, delta_used - delta_hp of every query row, the
      values whose sum over batch and rows this call adds to ``delta_error``;
    - ``pk``: (B, H, N, D) float32, sum_j P_ij k_j, with P the exact softmax of the FP32 scores
      (causal mask applied) and k from the kv head that query head h reads, h // (H // Hkv);

    and calls ``hook(delta_error_rows, pk)`` once with fresh tensors (the hook may keep them)
    (a hook with a method ``reduction(q)`` that returns a ``RowReduction`` is, on the Triton
    path, not called: the kernel reduces the rows itself, writing no per-row tensor; where
    ``reduction`` returns None it is called as usual):
    ``flash_attention(..., stats=stats)`` from its backward, after the dQ pass (a forward
    without backward calls nothing; the hook is looked up when the backward runs), and
    ``attention_statistics`` before it returns. Then, per call, the W^Q-gradient error is
    dQ_used - dQ_hp = -sm_scale * delta_error_rows[..., None] * pk. Nothing is synchronised
    with the host. Cost, only while the hook is set: the extra kernel work (a (BLOCK_M, D) FP32
    accumulator, one more matrix product per key tile, P rounded once to the input dtype; the dQ
    kernel with it holds fewer programs per SM) and
    4 * B * H * N * (D + 1) bytes per call (with a ``RowReduction``: a (D x BLOCK_M)(BLOCK_M x r)
    product in TF32 and D * r + 1 stored partial sums per row block, about r / BLOCK_M of those
    bytes, summed after the launch): set it on monitored steps only.
    An exception raised by the hook propagates to the caller of ``attention_statistics`` or of
    the backward.

    Example::

        stats = AttentionStats(q.shape[1], q.device)
        out = flash_attention(q, k, v, stats=stats)
        out.backward(grad)
        print(stats.as_dict())  # host copy: do this on monitored steps only
    """

    def __init__(self, num_heads: int, device: torch.device | str = "cpu", format: str = "bf16"):
        if not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        self.num_heads = num_heads
        self.device = torch.device(device)
        self.format = get_format(format).name
        # P_bar = exp(s - m) rounds to 1 in the format iff s - m >= unit_gap (a negative number)
        self.unit_gap = unit_gap(self.format)
        # Two buffers, every field a view of one row: reset() and packed() are a few kernel
        # launches however many fields there are (they run once per layer per monitored step).
        self._counts = torch.zeros(len(COUNT_FIELDS), num_heads, dtype=torch.int64, device=self.device)
        self._values = torch.zeros(len(MAX_FIELDS) + len(SUM_FIELDS), num_heads, dtype=torch.float32,
                                   device=self.device)
        for i, name in enumerate(COUNT_FIELDS):
            setattr(self, name, self._counts[i])
        for i, name in enumerate(MAX_FIELDS + SUM_FIELDS):
            setattr(self, name, self._values[i])
        self.max_logit.fill_(float("-inf"))
        self._rows_hook: Optional[RowsHook] = None

    @property
    def rows_hook(self) -> Optional[RowsHook]:
        """``hook(delta_error_rows, pk)`` called once per attention call, or None (class docstring)."""
        return self._rows_hook

    @rows_hook.setter
    def rows_hook(self, hook: Optional[RowsHook]) -> None:
        if hook is not None and not callable(hook):
            raise TypeError(f"rows_hook must be a callable hook(delta_error_rows, pk) or None, "
                            f"got {type(hook).__name__}")
        self._rows_hook = hook

    def reset(self) -> None:
        """Zero every field in place (max_logit back to -inf). No host synchronisation."""
        AttentionStats.reset_all([self])

    def packed(self) -> torch.Tensor:
        """All fields as one float64 tensor of shape (len(FIELDS), num_heads), on the device.

        One tensor so that a monitored step needs a single host transfer, and a distributed
        run a single all-reduce (sums for counts and delta sums, max for max_logit: reduce
        rows ``max_rows()`` with MAX and the others with SUM). Rows follow ``FIELDS``.
        """
        return AttentionStats.packed_all([self])

    @staticmethod
    def packed_all(stats: "list[AttentionStats]") -> torch.Tensor:
        """``packed()`` of several layers side by side: (len(FIELDS), sum of their heads) float64
        on the first one's device, columns in the order given. Four operations however many
        layers (a monitored step packs every layer at once)."""
        device = stats[0].device
        counts = torch.cat([s._counts.to(device) for s in stats], dim=1)
        values = torch.cat([s._values.to(device) for s in stats], dim=1)
        return torch.cat([counts.to(torch.float64), values.to(torch.float64)])

    @staticmethod
    def reset_all(stats: "list[AttentionStats]") -> None:
        """``reset()`` of several layers at once (three multi-tensor operations however many layers)."""
        if not stats:
            return
        torch._foreach_zero_([s._counts for s in stats])
        torch._foreach_zero_([s._values for s in stats])
        torch._foreach_add_([s.max_logit for s in stats], float("-inf"))  # 0 + -inf: exactly -inf

    @staticmethod
    def max_rows() -> list[int]:
        """Row indices of ``packed()`` that combine with max rather than sum."""
        return [FIELDS.index(name) for name in MAX_FIELDS]

    def as_dict(self) -> dict[str, list[float]]:
        """Host copy of every field as plain lists (one host synchronisation)."""
        values = self.packed().cpu()
        return {name: values[i].tolist() for i, name in enumerate(FIELDS)}

    def check_compatible(self, num_heads: int, device: torch.device) -> None:
        """Raise ValueError unless these statistics fit an attention call with these inputs."""
        if num_heads != self.num_heads:
            raise ValueError(
                f"stats has num_heads={self.num_heads} but q has {num_heads} heads; "
                "create AttentionStats(q.shape[1], q.device) for this layer")
        if torch.device(device) != self.device and not (
                self.device.type == device.type and self.device.index is None):
            raise ValueError(f"stats lives on {self.device} but q is on {device}; they must match")

    def __repr__(self) -> str:
        return f"AttentionStats(num_heads={self.num_heads}, device={self.device}, format={self.format!r})"


def fold_max_logit(stats: AttentionStats, max_logit: torch.Tensor) -> None:
    """``stats.max_logit`` (H,) raised to ``max_logit`` (H,) where that is larger: one call's own max
    logit, folded in by its backward (one launch, no sync)."""
    torch.maximum(stats.max_logit, max_logit, out=stats.max_logit)


class CallMaxLogit:
    """One call's own max logit per head, (H,) float32 from -inf, for a forward to write into
    (the forward kernels and the reference write only ``.max_logit``).

    The call's backward folds it into the layer's ``AttentionStats`` (``fold_max_logit``), so a
    forward whose backward never runs (an evaluation with gradients on, a forward that raised)
    adds nothing to the monitored step, as it adds no rows."""

    def __init__(self, num_heads: int, device: torch.device):
        self.max_logit = torch.full((num_heads,), float("-inf"), dtype=torch.float32, device=device)
