"""The W^Q-gradient error of a head, and what it does to W^Q's spectral norm (on the device).

The paper's chain (Qiu & Yao 2026, eq. 2-3): with X the input of the query projection
(B, N, C) and W^Q_h (D, C) head h's rows of it, the gradient of W^Q_h is dQ_h^T X. The
backward's delta error e = delta_used - delta_hp per query row changes dQ by

    dQ_used - dQ_hp = -sm_scale * e[..., None] * (P K)        (B, H, N, D)

so the head's W^Q-gradient error is dG_h = (dQ_used - dQ_hp)_h^T X (D x C): a sum over rows of
rank-1 matrices with the delta errors as coefficients. It accumulates into W^Q only if those
matrices keep one direction across steps, not merely if e keeps one sign.

Readings per head and monitored step (``FIELDS``, each (H,) float64):

- ``push``: -u^T dG_h v for the head's top singular pair (u, v) of W^Q_h: the first-order
  change of sigma_max(W^Q_h) that a plain gradient step of unit learning rate along the error
  would cause (positive: the error pushes sigma_max up). Computed as
  -sum_rows (dQ_err . u)(x . v), no D x C matrix formed.
- ``push_true``: the same for the true gradient G_h of W^Q_h, -u^T G_h v: read from W^Q's
  own gradient (a hook on the parameter, monitored steps only; each backward's contribution
  to it, so micro-batches of one step add up and nothing is counted twice), where W^Q is a
  trainable leaf parameter of the model (``families``' ``query_param``); otherwise from the
  query's gradient, -sum_rows (dQ . u)(x . v), the same quantity for the calls the chain sees.
- ``alignment``: cosine between this step's dG_h and the previous monitored step's.
- ``coherence``: ||S_h|| / N_h with S_h = lam S_h + dG_h and N_h = lam N_h + ||dG_h||, an
  exponentially weighted window of effective length W (lam = 1 - 1/W): 1 when dG keeps one
  direction, about sqrt((1 - lam) / (1 + lam)) (0.10 at W = 50) when its direction is random;
  NaN until two measured steps have had a non-zero error (one sample reads 1 whatever it is),
  and at a step whose error is exactly zero.

Alignment and coherence use a fixed random sketch dG_h Omega (Omega: C x r Gaussian, rounded to
BF16, r = ``SKETCH_DIM``, the same for every layer of one width, regenerated from a fixed seed):
inner products of sketches estimate those of the D x C matrices without forming them (a cosine of
two random directions reads about N(0, 1/r), one of a fixed direction reads 1).

Where the work happens, per attention call of a monitored step: x . v (B, H, N) and x Omega
(B, N, r) from the call's projection input, once (``_project``); then the rows' reductions
u^T dG v and dG Omega (FP32, per head) inside the Triton kernels' epilogues (the statistics
pass in observe mode, the dQ kernel in own-kernel mode: ``reduction``, nothing per row is
written), or, on the PyTorch paths (CPU reference, masked statistics), from the rows the hook
receives (``add_rows``, the same formula). The true gradient's push is one (D, C)
matrix-vector product per head and backward, on W^Q's gradient.

The pair (u, v) is the power iteration's as of the previous monitored step (the vectors move
slowly; the first monitored step uses the exact pair from attach). Defined where the query the
attention sees is the projection's output, or that output turned by rotary position embeddings
(RoPE, ``flashwatch.families``) whose rotation the call names: each row's error is turned back
(``unrotate``) before it is mapped onto W^Q, on the PyTorch path (the kernels store such rows
instead of reducing them). Under FSDP the pair comes from the power iteration on the shards
(``pair_from_products``) and the true gradient's push from the query's gradient; under tensor
parallelism each rank computes its own heads (their rows, pairs and window state; the true
gradient's push from the query's gradient), filed under their global indices; not defined for a
layout the shards cannot be read in: those layers read NaN.

``LayerChain`` holds one layer's accumulators; ``Chains`` is the Monitor's view of all its
layers' chains: made at attach, averaged over the ranks that hold each head, read, and given the
next singular pairs at every monitored step.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, NamedTuple

import torch

from .families import FAMILIES
from .kernels import uses_triton
from .signals import top_eigenvector

__all__ = ["FIELDS", "SKETCH_DIM", "CHAIN_FAMILIES", "LayerChain", "Chains", "top_pair", "pair_from_products",
           "unrotate", "check_rotation"]

FIELDS = ("push", "push_true", "alignment", "coherence")
SKETCH_DIM = 64  # r: a random cosine reads about N(0, 1/64), sd 0.125
_SEED = 20260101  # fixed: Omega is part of the definition, so a resumed run uses the same one
# model families whose query is the projection's output of the module's input, possibly rotated
# (dQ, turned back where rotated, maps onto W^Q)
CHAIN_FAMILIES = frozenset(f.name for f in FAMILIES)


def unrotate(t: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The gradient of the query before rotary position embeddings from its gradient after them.

    Hugging Face's RoPE turns a query row q (head dim D, halves q1, q2) into q cos + [-q2, q1] sin
    with ``rotation = (cos, sin)``, each (B or 1, N, D); its transpose maps a gradient row g to
    g cos + [(g sin)2, -(g sin)1]. ``t``: (B, H, N, D) rows after the rotation; returns them before
    it, in float32."""
    cos, sin = (r.float()[:, None] for r in rotation)  # (B or 1, 1, N, D)
    t = t.float()
    y = sin * t
    half = t.shape[-1] // 2
    return cos * t + torch.cat([y[..., half:], -y[..., :half]], dim=-1)


QUERY_TOLERANCE = 0.05  # the largest relative residual of a query that is W^Q x (BF16 rounding: ~0.005)


@torch.no_grad()
def query_residual(query: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                   rotation: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
    """How far the query an attention call receives is from W^Q x, the relation the W^Q-gradient
    error rests on: ||r - mean r|| / ||W^Q x - mean W^Q x||, r = query (turned back through
    ``rotation``) - W^Q x, the means over batch and positions (a bias is a constant r). ``query``:
    (B, H, N, D); ``x``: (B, N, C); ``weight``: (H, D, C). About 0.005 under BF16; a query
    normalised, scaled or rotated on its way (QK-norm, a query scale) gives a large value.

    A residual within the query's own rounding, ||r - mean r|| <= eps(query dtype) ||query||
    (BF16: 2^-7), counts as none: where a large bias dominates the query (its mean 100 times its
    spread over tokens, seen in training), BF16 rounding of the query alone is a sizeable part of
    the spread, and is no sign that the query is something other than W^Q x."""
    lin = torch.einsum("bnc,hdc->bhnd", x.float(), weight.float())
    q = unrotate(query, rotation) if rotation is not None else query.float()  # RoPE is orthogonal: R^T = R^-1
    r = q - lin
    r = r - r.mean(dim=(0, 2), keepdim=True)
    if r.norm() <= torch.finfo(query.dtype).eps * q.norm():
        return 0.0
    spread = lin - lin.mean(dim=(0, 2), keepdim=True)
    return float(r.norm() / spread.norm().clamp_min(1e-30))


def check_rotation(rotation: Any, x: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``rotation`` as (cos, sin) if it is one for the call whose projection input is ``x``
    (B, N, C) and whose head dim is ``d``: each (B or 1, N, d), d even; else None (another
    convention, such as complex frequencies or a rotation of part of the head, is not read)."""
    if not (isinstance(rotation, (tuple, list)) and len(rotation) == 2
            and all(isinstance(r, torch.Tensor) for r in rotation)) or x.dim() != 3:
        return None
    cos, sin = rotation
    if (cos.shape != sin.shape or cos.dim() != 3 or cos.shape[0] not in (1, x.shape[0])
            or tuple(cos.shape[1:]) != (x.shape[1], d) or d % 2 or not cos.is_floating_point()):
        return None
    return cos.detach(), sin.detach()


def _omega(width: int, device: torch.device) -> torch.Tensor:
    """Omega (width, r): Gaussian entries of variance 1/r, each rounded to BF16 so that a BF16
    activation's product with it needs one BF16 term (``_Factor``'s ``split``)."""
    g = torch.Generator().manual_seed(_SEED + width)
    omega = torch.randn(width, SKETCH_DIM, generator=g, dtype=torch.float32) / math.sqrt(SKETCH_DIM)
    return omega.to(torch.bfloat16).float().to(device)


@torch.no_grad()
def top_pair(weight: torch.Tensor, v_block: torch.Tensor,
             top: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top singular pair of each head from a block power iteration's subspace.

    Args:
        weight: (N, D, C) query weights.
        v_block: (N, C, k) orthonormal right vectors (``PowerIteration.v``).
        top: (N, k), the top eigenvector of (W V)^T (W V) for this weight and block when already
            known (``PowerIteration.top_in_block``, from the step that made ``v_block``); None:
            computed here.

    Returns:
        u (N, D) and v (N, C), unit vectors with W v = sigma u (Rayleigh-Ritz in the block).
    """
    w = weight.detach().float()
    if top is None:
        y = torch.bmm(w, v_block)  # (N, D, k)
        top = top_eigenvector(torch.bmm(y.transpose(1, 2), y))  # (N, k); no eigh: nothing makes the host wait
    v = _unit(torch.bmm(v_block, top[..., None])[..., 0])
    return _unit(torch.bmm(w, v[..., None])[..., 0]), v


@torch.no_grad()
def pair_from_products(y: torch.Tensor, v_block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_pair`` from y = W V (N, D, k) and V (N, C, k) instead of W: with a the top eigenvector
    of y^T y, v = V a and u = y a = W v, normalised (where W is held in pieces, as FSDP's shards,
    y is what the power iteration completes on every rank)."""
    y = y.float()
    a = top_eigenvector(torch.bmm(y.transpose(1, 2), y))[..., None]  # (N, k, 1); no eigh: nothing makes the host wait
    return _unit(torch.bmm(y, a)[..., 0]), _unit(torch.bmm(v_block.float(), a)[..., 0])


class _Factor:
    """A float32 matrix m (C, k) that activations x (..., C) are multiplied by, x @ m in float32.

    A BF16 x on CUDA is multiplied as it is, against m's first ``split`` columns (all by default)
    split into two BF16 matrices, m = hi + lo + (at most 2^-16 |m| per entry: BF16 keeps 8
    significant bits, twice), and its other columns in BF16 alone (the caller makes them exact in
    BF16, as ``_omega`` is), in one tensor-core
    product with FP32 accumulation and output (``torch.mm``'s ``out_dtype``): no FP32 copy of x,
    which is the larger part of the FP32 product's cost (x: B*N x C, m: C x (H + r)), with an error
    of the FP32 product's size (x's BF16 entries are exact; at C = 768 FP32 accumulation alone may
    err by 768 * 2^-24, about 2^-14.6, of the terms' absolute sum; TF32, where users turn it on,
    by 2^-11). Elsewhere, and with a torch whose ``mm`` has no ``out_dtype``, x is turned to float32
    first."""

    split_product = True  # False once a torch without mm's out_dtype refused it (a process-wide fact)

    def __init__(self, m: torch.Tensor, split: int | None = None, parts: torch.Tensor | None = None):
        self.m = m.float().contiguous()
        self.k = self.m.shape[1]
        self.split = self.k if split is None else split
        if not 0 <= self.split <= self.k:
            raise ValueError(f"split must be between 0 and the factor's {self.k} columns, got {split}")
        # [hi | lo] (C, k + split) BF16: given (``stacked``), or made at the first BF16 x
        self._parts: torch.Tensor | None = parts

    def parts(self) -> torch.Tensor:
        if self._parts is None:
            self._parts = _split_parts(self.m, self.split)
        return self._parts

    @staticmethod
    def stacked(ms: torch.Tensor, split: int) -> "list[_Factor]":
        """One factor per matrix of ``ms`` (L, C, k), their BF16 parts made together where the split
        product applies (CUDA): the same values as each made alone, in a handful of launches
        however many layers."""
        ms = ms.float().contiguous()
        parts = _split_parts(ms, split).unbind(0) if _Factor.split_product and ms.is_cuda else [None] * len(ms)
        return [_Factor(m, split, p) for m, p in zip(ms.unbind(0), parts)]

    def times(self, x: torch.Tensor, h: int) -> "_Projection":
        """x (B, N, C) @ m in float32 as views of one product (the product's single launch, no
        copies): x @ m[:, :h] as (B, h, N) and x @ m[:, h:] as (B, N, k - h), each with its split
        product's low term where it has one. ``split`` must be h (the chain: v split, Omega in
        one term) or every column. The product is made transposed, (k, B N): a column of x @ m
        runs along memory, so the kernels read each view's rows coalesced."""
        B, N, k, s = x.shape[0], x.shape[1], self.k, self.split
        if s not in (h, k):
            raise ValueError(f"a factor split in its first {s} of {k} columns is read apart at {h}: "
                             f"split must be {h} or {k}")
        yt = self._split_product(x)
        if yt is None:
            yt = (self.m.t() @ x.reshape(-1, x.shape[-1]).float().t()).view(k, B, N)
            return _Projection(yt[:h].permute(1, 0, 2), None, yt[h:].permute(1, 2, 0), None)
        yt = yt.view(k + s, B, N)  # [x hi | x lo] transposed
        return _Projection(yt[:h].permute(1, 0, 2), yt[k: k + h].permute(1, 0, 2), yt[h:k].permute(1, 2, 0),
                           yt[k + h:].permute(1, 2, 0) if s == k else None)

    def _split_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """(x (..., C) @ [hi | lo]) transposed, (k + split, prod(...)) float32, where the split product
        applies, else None."""
        if _Factor.split_product and _split_applies(x):
            try:
                return torch.mm(self.parts().t(), x.reshape(-1, x.shape[-1]).t(), out_dtype=torch.float32)
            except torch.cuda.OutOfMemoryError:
                raise  # the FP32 path needs more memory still
            except (TypeError, NotImplementedError, RuntimeError):  # mm without out_dtype (torch before 2.8),
                _Factor.split_product = False  # or a build that refuses it: the FP32 product from now on
        return None


class _Projection(NamedTuple):
    """One call's x . v_h and x Omega (float32 views of one product, ``_Factor.times``): ``xv`` (B, H, N)
    and ``xo`` (B, N, r), each with the low term of a split product to add (``xv_lo``, ``xo_lo``) or
    None. The Triton kernels read ``xv``, ``xv_lo`` and ``xo`` in place (``RowReduction``)."""

    xv: torch.Tensor
    xv_lo: torch.Tensor | None
    xo: torch.Tensor
    xo_lo: torch.Tensor | None

    def along_v(self) -> torch.Tensor:
        """x . v_h (B, H, N), the terms added."""
        return self.xv if self.xv_lo is None else self.xv + self.xv_lo

    def along_omega(self) -> torch.Tensor:
        """x Omega (B, N, r), the terms added."""
        return self.xo if self.xo_lo is None else self.xo + self.xo_lo


def _split_parts(m: torch.Tensor, split: int) -> torch.Tensor:
    """[hi | lo] (..., C, k + split) BF16 for m (..., C, k) float32: hi = m in BF16, lo = what hi
    misses of m's first ``split`` columns, in BF16."""
    hi = m.to(torch.bfloat16)
    lo = (m[..., :split] - hi[..., :split].float()).to(torch.bfloat16)
    return torch.cat([hi, lo], dim=-1)


def _split_applies(x: torch.Tensor) -> bool:
    """Whether ``_Factor.times`` multiplies x in BF16 parts: a BF16 tensor on CUDA (where mm has out_dtype)."""
    return x.dtype == torch.bfloat16 and x.is_cuda


def _flags(values: list, device: torch.device) -> torch.Tensor:
    """(L, 1) bool on ``device`` from per-chain flags: host booleans (made by fills, not copied from
    the host: nothing waits; one fill when they agree, as they do when every layer was measured)
    or 0-d device booleans (after the ranks' mean)."""
    if all(isinstance(v, bool) for v in values) and len(set(values)) == 1:
        return torch.full((len(values), 1), values[0], dtype=torch.bool, device=device)
    return torch.stack([v if isinstance(v, torch.Tensor) else torch.full((), v, dtype=torch.bool, device=device)
                        for v in values])[:, None]


class _StackedState:
    """The window state and accumulators of chains of one shape and device held as (L, ...) tensors,
    each chain's own tensors being their rows (views), so that a monitored step reads and updates
    every chain in place at once (``flashwatch.kernels.chain_reading``).

    Made by ``of`` from the chains' current values. A chain whose tensor was replaced since
    (``load_state_dict``, ``set_flat`` after a ranks' mean) is seen at the next ``of``, which
    stacks the current values again. Held by the first chain, its members weakly."""

    FIELDS = ("sketch", "prev", "ew_sum", "ew_norm", "has_prev", "ugv", "push_true")

    def __init__(self, chains: "list[LayerChain]"):
        self.members = [weakref.ref(c) for c in chains]
        self.buffers = {name: torch.stack([getattr(c, name) for c in chains]) for name in self.FIELDS}
        self.views = [{name: self.buffers[name][i] for name in self.FIELDS} for i in range(len(chains))]
        for c, views in zip(chains, self.views):
            for name, view in views.items():
                setattr(c, name, view)

    def holds(self, chains: "list[LayerChain]") -> bool:
        """Whether these are the chains stacked, in order, each still holding its rows."""
        return len(chains) == len(self.members) and all(
            ref() is c and all(getattr(c, name) is view for name, view in views.items())
            for ref, c, views in zip(self.members, chains, self.views))

    @staticmethod
    def of(chains: "list[LayerChain]") -> "_StackedState":
        first = chains[0]
        if first._stacked is None or not first._stacked.holds(chains):
            first._stacked = _StackedState(chains)
        return first._stacked


def _unit(t: torch.Tensor) -> torch.Tensor:
    """Each row of t (N, n) scaled to norm 1 (a zero row stays zero)."""
    return t / t.norm(dim=1, keepdim=True).clamp_min(1e-30)


class LayerChain:
    """Device-side accumulators and window state of one layer's W^Q-error chain.

    A monitored step: ``add_rows(x, e_rows, pk, scale)`` from the statistics pass (backward);
    the true gradient through ``watch_weight`` (W^Q's gradient hook, ``add_weight_grad``) or,
    where that cannot apply, ``add_query_grad(x, dq)`` from the query's gradient hook;
    ``reading(lam)`` at the end returns the (len(FIELDS), H) float64 readings and starts the
    next step (removing the weight hook). No host sync.
    """

    def __init__(self, num_heads: int, head_dim: int, width: int, device: torch.device, *,
                 head_offset: int = 0, total_heads: int | None = None):
        self.num_heads, self.head_dim, self.width = num_heads, head_dim, width
        # under tensor parallelism this rank's heads are [head_offset, head_offset + num_heads) of
        # total_heads: the ranks' accumulators are combined in those global columns (``flat``)
        self.head_offset = head_offset
        self.total_heads = num_heads if total_heads is None else total_heads
        if head_offset < 0 or head_offset + num_heads > self.total_heads:
            raise ValueError(f"heads {head_offset}..{head_offset + num_heads - 1} do not fit a layer of "
                             f"{self.total_heads} heads")
        self.device = torch.device(device)
        self.omega = _omega(width, self.device)
        h, d, r = num_heads, head_dim, SKETCH_DIM
        self.u = torch.zeros(h, d, device=self.device)
        self.v = torch.zeros(h, width, device=self.device)
        self.ugv = torch.zeros(h, device=self.device)  # u^T dG v of this step's error (FP32; push = -ugv)
        self.push_true = torch.zeros(h, dtype=torch.float64, device=self.device)
        self.sketch = torch.zeros(h, d, r, device=self.device)
        self.prev = torch.zeros(h, d, r, device=self.device)
        self.has_prev = torch.zeros(h, dtype=torch.bool, device=self.device)
        self.ew_sum = torch.zeros(h, d, r, device=self.device)
        self.ew_norm = torch.zeros(h, dtype=torch.float64, device=self.device)
        self.rows_calls = 0  # statistics passes added this step
        self.grad_calls = 0
        self._touched = False  # whether anything may have added into this step's accumulators
        self.pending_hooks: list = []  # own-kernel mode: rows hooks of calls whose backward has not run
        self.weight_hook = None  # handle of the W^Q gradient hook of the current monitored step
        self._seen = None  # (rows seen, query gradient seen) as device booleans after a ranks' mean
        self._projected = None  # (weakref to x, its _Projection) of the current call (see _project)
        self._both: _Factor | None = None  # [v^T | Omega] (C, H + r) for _project
        # chains whose pairs were set with this one's (``Chains.start``), held weakly: no reference cycle keeps
        # a detached Monitor's chains (and their device memory) alive
        self._siblings: list[weakref.ref] = []
        self._push_scratch = None  # the push kernel's buffers (``chain_sums.PushScratch``), made at its first launch
        self._stacked: _StackedState | None = None  # this and its group's state stacked, where it reads them first

    def set_pair(self, u: torch.Tensor, v: torch.Tensor) -> None:
        """The top singular pair (u (H, D), v (H, C)) used from the next call on."""
        self.u = u.to(self.device, torch.float32).contiguous()  # contiguous: the kernels read them so
        self.v = v.to(self.device, torch.float32).contiguous()
        self._projected = None
        self._both = None  # [v^T | Omega] (C, H + r), made at the first call

    @staticmethod
    @torch.no_grad()
    def make_factors(chains: "list[LayerChain]") -> None:
        """Each chain's [v^T | Omega] (``_project``'s factor) for its current pair, the chains of one
        shape and device made together (a monitored step's launches do not grow with the depth of
        the model), for those that have none; the same factors each would make alone."""
        groups: dict[tuple, list[LayerChain]] = {}
        for c in chains:
            if c._both is not None:
                continue
            groups.setdefault((c.num_heads, c.width, c.device), []).append(c)
        for members in groups.values():
            first = members[0]
            vt = torch.stack([c.v for c in members]).transpose(1, 2)  # (L, C, H)
            omega = first.omega.expand(len(members), *first.omega.shape)  # (L, C, r): one Omega per width
            for c, factor in zip(members, _Factor.stacked(torch.cat([vt, omega], dim=2), split=first.num_heads)):
                c._both = factor

    def _check(self, x: torch.Tensor, t: torch.Tensor) -> None:
        """x must be (B, N, C) matching t's (B, ., N, .)."""
        if x.dim() != 3 or x.shape[-1] != self.width or x.shape[0] != t.shape[0] or x.shape[1] != t.shape[2]:
            raise ValueError(f"projection input of shape {tuple(x.shape)} does not match attention tensors "
                             f"{tuple(t.shape)} (expected (B, N, {self.width}))")

    def _project(self, x: torch.Tensor, t: torch.Tensor) -> _Projection:
        """x . v_h (B, H, N) and x Omega (B, N, r) for one call's projection input x (B, N, C), made once
        per call (one product): the rows hook and the query's gradient hook of a call share the same x.

        x is remembered weakly: x is the model's activation, which its backward frees; holding it
        past the call would change when the model's memory is freed (under CUDA graphs,
        ``torch.compile(mode="reduce-overhead")``, a graph recorded on an unmonitored step refuses
        to replay when a tensor it freed then is still alive)."""
        if self._projected is None or self._projected[0]() is not x:
            self._check(x, t)
            h = self.num_heads
            if self._both is None:
                # (C, H + r): v split in two BF16 terms, Omega exact in BF16 in one; made for every chain
                # whose pair was set with this one (held from the monitored step's first call to its end)
                siblings = [c for c in (ref() for ref in self._siblings) if c is not None]
                LayerChain.make_factors(siblings if self in siblings else [self])
            self._projected = (weakref.ref(x), self._both.times(x, h))  # one product for both
        return self._projected[1]

    def _along_u(self, t: torch.Tensor) -> torch.Tensor:
        """t (B, H, N, D) . u_h -> (B, H, N), in float32 (no (B, H, N, D) product formed)."""
        return torch.matmul(t.float(), self.u[None, :, :, None])[..., 0]

    @torch.no_grad()
    def add_rows(self, x: torch.Tensor, e_rows: torch.Tensor, pk: torch.Tensor, scale: float,
                 rotation: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """One call's rows: e_rows (B, H, N), pk (B, H, N, D), x (B, N, C) (the PyTorch paths).

        dQ_err = c[..., None] * pk with c = -scale * e_rows, so u^T dG v = sum_rows c (pk . u)(x . v)
        and the sketch dG Omega = sum_rows c pk^T (x Omega), both without forming dQ_err. The
        Triton kernels add the same sums in their epilogue instead (``reduction``). A rotated
        query (``rotation``: the call's RoPE (cos, sin)) has its rows turned back first."""
        self._touched = True
        if rotation is not None:
            pk = unrotate(pk, rotation)
        projection = self._project(x, pk)
        c = (-scale) * e_rows.float()  # (B, H, N)
        self.ugv += (c * self._along_u(pk) * projection.along_v()).sum(dim=(0, 2))
        weighted = c[..., None] * projection.along_omega()[:, None]  # (B, H, N, r)
        self.sketch += torch.matmul(pk.float().transpose(-1, -2), weighted).sum(0)  # (H, D, r)
        self.rows_calls += 1

    @torch.no_grad()
    def reduction(self, x: torch.Tensor, q: torch.Tensor):
        """One call's factors for the kernels' in-epilogue reduction (``flashwatch.kernels.stats.
        RowReduction``): u, x . v (B, H, N), x Omega (B, N, r) for the projection input x (B, N, C)
        of the call whose query is q (B, H, N, D), and this step's ``ugv`` and ``sketch`` to add
        into: the same sums as ``add_rows`` with the call's sm_scale, no per-row tensor formed."""
        from .kernels.stats import RowReduction

        self._touched = True
        p = self._project(x, q)  # read in place by the kernels: the chain's Omega has no low term
        return RowReduction(self.u, p.xv, p.xo, self.ugv, self.sketch, self._rows_added, xv_lo=p.xv_lo)

    def _rows_added(self) -> None:
        self.rows_calls += 1

    @torch.no_grad()
    def add_query_grad(self, x: torch.Tensor, dq: torch.Tensor,
                       rotation: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """The true gradient's push from one call's dQ (B, H, N, D) and its projection input x
        (dQ turned back first where the query was rotated: ``rotation``, as ``add_rows``)."""
        self._touched = True
        if rotation is not None:
            dq = unrotate(dq, rotation)
        xv = self._project(x, dq).along_v()
        self.push_true -= (self._along_u(dq) * xv).sum(dim=(0, 2)).double()
        self.grad_calls += 1

    @torch.no_grad()
    def add_weight_grad(self, grad_rows: torch.Tensor) -> None:
        """The true gradient's push -u_h^T G_h v_h from one backward's gradient of W^Q, (H, D, C)
        (each head's rows): elementwise products in FP32 (float64 for a float64 gradient; no TF32, no
        float64 copy of the gradient), their sums in float64."""
        if tuple(grad_rows.shape) != (self.num_heads, self.head_dim, self.width):
            raise ValueError(f"W^Q gradient of shape {tuple(grad_rows.shape)}, expected "
                             f"{(self.num_heads, self.head_dim, self.width)}")
        self._touched = True
        g = grad_rows.to(self.device)
        if uses_triton(g.device):  # one launch (flashwatch.kernels.chain_sums), the same sums
            from .kernels import chain_sums

            if self._push_scratch is None:
                self._push_scratch = chain_sums.PushScratch()
            chain_sums.subtract_push(g, self.u, self.v, self.push_true, self._push_scratch)
        elif g.stride(2) <= g.stride(1):  # C runs along memory (nn.Linear's layout): sum over C first
            gv = (g * self.v[:, None, :]).sum(2, dtype=torch.float64)  # (H, D)
            self.push_true -= (gv * self.u).sum(1)
        else:  # D runs along memory (Conv1D's transposed layout): over D first, a contiguous reduction too
            gu = (g * self.u[:, :, None]).sum(1, dtype=torch.float64)  # (H, C)
            self.push_true -= (gu * self.v).sum(1)
        self.grad_calls += 1

    def watch_weight(self, param: Any, transposed: bool, active: Callable[[], bool],
                     on_error: Callable[[str, BaseException], None]) -> bool:
        """Read the true gradient from W^Q's parameter for the rest of this monitored step.

        Args:
            param: the parameter holding W^Q (``Family.query_param``): its first H*D rows (of its
                transpose when ``transposed``) are W^Q, head h owning D of them.
            active: whether a monitored step is on: a hook that fires outside one removes itself.
            on_error: ``on_error("wq_error_chain", exc)`` for a failure inside the hook.

        Returns:
            True if the hook is in place (already, or now); False where it cannot apply (not a
            trainable leaf tensor of the expected size): the caller then uses ``add_query_grad``.
        The hook sees each backward's contribution to the gradient before it is accumulated
        (under data parallelism: this rank's own, before the ranks' mean)."""
        if self.weight_hook is not None:
            return True
        h, d, c = self.num_heads, self.head_dim, self.width
        if not (isinstance(param, torch.Tensor) and param.is_leaf and param.requires_grad and param.dim() == 2):
            return False
        rows, cols = (param.shape[1], param.shape[0]) if transposed else tuple(param.shape)
        if rows < h * d or cols != c:
            return False

        def on_weight_grad(grad):
            if not active():
                self.unwatch()
                return None
            try:
                g = grad.t() if transposed else grad
                self.add_weight_grad(g[: h * d].reshape(h, d, c))
            except Exception as exc:  # never reaches the backward
                on_error("wq_error_chain", exc)
            return None

        self.weight_hook = param.register_hook(on_weight_grad)
        return True

    def unwatch(self) -> None:
        """Remove W^Q's gradient hook (end of a monitored step, or detach)."""
        if self.weight_hook is not None:
            self.weight_hook.remove()
            self.weight_hook = None

    @property
    def flat_size(self) -> int:
        return self.total_heads * self._per_head + 2

    @property
    def _per_head(self) -> int:
        """Values per head in ``flat()``: -ugv, push_true, the sketch (D x r)."""
        return 2 + self.head_dim * SKETCH_DIM

    def flat(self) -> torch.Tensor:
        """This step's accumulators as one float64 vector for combining over ranks: a (total heads,
        2 + D r) block, each head's row [-ugv, push_true, sketch], this rank's heads in their global
        rows and zeros elsewhere (tensor parallelism), then this step's call counts (2)."""
        calls = torch.stack([torch.full((), float(n), dtype=torch.float64, device=self.device)
                             for n in (self.rows_calls, self.grad_calls)])
        rows = torch.cat([-self.ugv.double()[:, None], self.push_true[:, None],
                          self.sketch.flatten(1).double()], dim=1)  # (H, 2 + D r)
        if self.total_heads != self.num_heads:
            full = rows.new_zeros(self.total_heads, rows.shape[1])
            full[self.head_offset: self.head_offset + self.num_heads] = rows
            rows = full
        return torch.cat([rows.flatten(), calls])

    def set_flat(self, t: torch.Tensor, owners: torch.Tensor | float = 1.0) -> None:
        """Take the accumulators back from ``flat()``'s layout summed over ranks: each head's row
        divided by how many ranks hold that head (``owners``: a number, or (total heads,) on this
        device), so the mean over the ranks that computed it."""
        h, off = self.num_heads, self.head_offset
        rows = t[:-2].view(self.total_heads, self._per_head)
        if isinstance(owners, torch.Tensor):
            owners = owners[off: off + h, None]
        rows = rows[off: off + h] / owners
        self.ugv = (-rows[:, 0]).float()
        self.push_true = rows[:, 1].clone(memory_format=torch.contiguous_format)
        self.sketch = rows[:, 2:].reshape(self.sketch.shape).float()
        self._seen = (t[-2] > 0, t[-1] > 0)  # device scalars: no host sync

    @torch.no_grad()
    def unscale_(self, inverse_scale: torch.Tensor) -> None:
        """This step's accumulators divided by a loss scale S: ``inverse_scale`` = 1/S, a 0-d float64
        tensor (``flashwatch.loss_scale``). NaN (a step the scaler skipped, or S unknown) leaves the
        step unread: its readings NaN and the window state as it was, as for a step nothing fed."""
        inverse_scale = inverse_scale.to(self.device)
        single = inverse_scale.float()
        self.ugv.mul_(single)  # in place: the kernels add into these same tensors
        self.sketch.mul_(single)
        self.push_true.mul_(inverse_scale)
        rows, grads = self._seen if self._seen is not None else (self.rows_calls > 0, self.grad_calls > 0)
        known = inverse_scale.isfinite()
        self._seen = (known & rows, known & grads)  # device booleans: no host sync

    def reading(self, lam: float) -> torch.Tensor:
        """This step's readings (len(FIELDS), H) float64 on the device; starts the next step.

        NaN for a step with no statistics pass (the window state is then left as it was); no
        host synchronisation."""
        return LayerChain.read_all([self], lam)[0]

    @property
    def fed(self) -> bool:
        """Whether anything may have reached this step's accumulators (else every reading is NaN)."""
        return self._seen is not None or self._touched

    @staticmethod
    @torch.no_grad()
    def read_all(chains: "list[LayerChain]", lam: float) -> torch.Tensor:
        """``reading(lam)`` of several chains of one shape and device at once: (len(chains),
        len(FIELDS), H) float64, each chain's window state updated and its next step started. The
        same operations as one chain's, on the chains stacked (a monitored step's launches do
        not grow with the depth of the model)."""
        first = chains[0]
        h, device = first.num_heads, first.device
        if not any(c.fed for c in chains):
            # nothing was added this step (no statistics pass fed the chains, as under torch.compile):
            # every reading is NaN and the window state stays as it is, known on the host
            for c in chains:
                c._end_step()
            return torch.full((len(chains), len(FIELDS), h), math.nan, dtype=torch.float64, device=device)
        rows_seen = _flags([c._seen[0] if c._seen is not None else c.rows_calls > 0 for c in chains], device)
        grad_seen = _flags([c._seen[1] if c._seen is not None else c.grad_calls > 0 for c in chains], device)
        if uses_triton(device):  # one launch on the chains' state held stacked (flashwatch.kernels.chain_reading)
            from .kernels.chain_reading import read_chains

            out = read_chains(_StackedState.of(chains).buffers, rows_seen, grad_seen, lam)
            for c in chains:
                c._end_step()
            return out
        rows_seen4 = rows_seen[..., None, None]  # (L, 1, 1, 1) against (L, H, D, r)

        def stacked(name: str) -> torch.Tensor:
            return torch.stack([getattr(c, name) for c in chains])

        g, prev, ew_sum = stacked("sketch"), stacked("prev"), stacked("ew_sum")  # (L, H, D, r)
        ew_norm, has_prev = stacked("ew_norm"), stacked("has_prev")  # (L, H)
        nan = torch.full((h,), math.nan, dtype=torch.float64, device=device)
        norm = g.flatten(2).norm(dim=2).double()  # (L, H)
        dot = (g * prev).flatten(2).sum(2).double()
        den = norm * prev.flatten(2).norm(dim=2).double()
        alignment = torch.where(rows_seen & has_prev & (den > 0), dot / den.clamp_min(1e-300), nan)
        # one sample is coherent by definition (||g|| / ||g|| = 1): a reading once an earlier step added
        # a non-zero error to the window (its norm sum above 0 before this step's)
        earlier = ew_norm > 0
        ew_sum = torch.where(rows_seen4, lam * ew_sum + g, ew_sum)
        ew_norm = torch.where(rows_seen, lam * ew_norm + norm, ew_norm)
        s_norm = ew_sum.flatten(2).norm(dim=2).double()
        coherence = torch.where(rows_seen & earlier & (norm > 0), s_norm / ew_norm.clamp_min(1e-300), nan)
        out = torch.stack([torch.where(rows_seen, -stacked("ugv").double(), nan),
                           torch.where(grad_seen, stacked("push_true"), nan), alignment, coherence], dim=1)
        torch._foreach_copy_([c.ew_sum for c in chains], ew_sum.unbind(0))
        torch._foreach_copy_([c.ew_norm for c in chains], ew_norm.unbind(0))
        torch._foreach_copy_([c.prev for c in chains], torch.where(rows_seen4, g, prev).unbind(0))
        torch._foreach_copy_([c.has_prev for c in chains], (has_prev | rows_seen).unbind(0))
        for name in ("ugv", "push_true", "sketch"):  # the next step's accumulators (read above: stacked copies)
            torch._foreach_zero_([getattr(c, name) for c in chains])
        for c in chains:
            c._end_step()
        return out

    def _end_step(self) -> None:
        """Host state of the next step: no calls counted, no hooks pending, W^Q's hook removed."""
        self.rows_calls = self.grad_calls = 0
        self._touched = False
        self._seen = None
        self._projected = None
        self.pending_hooks.clear()
        self.unwatch()

    _STATE = ("u", "v", "prev", "has_prev", "ew_sum", "ew_norm")  # what a resumed run continues from

    def state_dict(self) -> dict:
        return {k: getattr(self, k).detach().cpu().clone() for k in self._STATE}

    def _own(self, state: dict) -> dict:
        """``state``'s tensors for this layer's heads (a tensor-parallel rank takes its own of every head's);
        ValueError where they do not fit."""
        out = {}
        for k in self._STATE:
            mine, saved = getattr(self, k), state[k]
            if self.total_heads != self.num_heads and saved.shape[:1] == (self.total_heads,):
                saved = saved[self.head_offset: self.head_offset + self.num_heads]
            if tuple(saved.shape) != tuple(mine.shape):
                raise ValueError(f"saved W^Q-error state {k} has shape {tuple(state[k].shape)}, this layer needs "
                                 f"{tuple(mine.shape)} (heads, head dimension or model width differ)")
            out[k] = saved
        return out

    def check_state(self, state: dict) -> None:
        """Raise ValueError unless ``state`` (``state_dict()``) fits this layer."""
        self._own(state)

    def load_state_dict(self, state: dict) -> None:
        """From ``state_dict()``: this layer's heads, or every head's (a tensor-parallel rank takes its own)."""
        for k, saved in self._own(state).items():
            setattr(self, k, saved.to(device=self.device, dtype=getattr(self, k).dtype)
                    .clone(memory_format=torch.contiguous_format))
        self._projected = self._both = None  # made again from the loaded v


class Chains:
    """The W^Q-error chains of a Monitor's attached layers (``layer.chain``: a ``LayerChain``, or
    None where the chain is not defined).

    Args:
        layers: the attached layers, their chains already made (``Chains.make``).
        on_error: ``on_error(kind, exc)`` for a failure (kind ``"wq_error_chain"``); the
            readings of a failed step are NaN, and training goes on.
    """

    def __init__(self, layers: list, on_error: Callable[[str, BaseException], None]):
        self.layers, self.on_error = layers, on_error

    @staticmethod
    def make(family: str, shape: tuple[int, int, int], device: torch.device, placement: str, *,
             head_offset: int = 0, total_heads: int | None = None) -> LayerChain | None:
        """A layer's chain for its query weight of ``shape`` (this rank's heads, D, C) on ``device``,
        or None where it is not defined: a family without one, or a ``placement``
        (``AttentionLayer.placement_kind``) other than a whole weight, FSDP's shards (every rank
        computes its heads' full rows) or tensor parallelism (a rank computes its heads' rows:
        ``head_offset`` of ``total_heads``; also under FSDP2). The ranks' accumulators of a head average over the
        ranks that hold it, as under DDP."""
        if placement not in ("whole", "fsdp", "tensor_parallel") or family not in CHAIN_FAMILIES:
            return None
        return LayerChain(shape[0], shape[1], shape[2], device, head_offset=head_offset, total_heads=total_heads)

    @property
    def chains(self) -> list[LayerChain]:
        return [layer.chain for layer in self.layers if layer.chain is not None]

    def start(self, wq: Any) -> None:
        """At attach: each chain starts from the exact top singular pairs of its W^Q (``WqNorms``)."""
        started = []
        for index, (u, v) in wq.pairs().items():
            chain = self.layers[index].chain
            if chain is not None:
                chain.set_pair(u, v)
                started.append(chain)
        refs = [weakref.ref(chain) for chain in started]
        for chain in started:  # the first call that needs a factor makes every chain's (``_project``)
            chain._siblings = refs

    def update_pairs(self, wq: Any) -> None:
        """After a monitored step's power iteration: each chain gets the top singular pairs of the
        weights just measured, for the next step."""
        if wq is None or not self.chains:
            return
        try:
            self.start(wq)
        except Exception as exc:
            self.on_error("wq_error_chain", exc)

    def average(self, reducer: Any) -> None:
        """Under data parallelism (``reducer``: a ``flashwatch.distributed.Reducer``, else None): the
        step's accumulators averaged over the ranks that hold each head (every rank, or under tensor
        parallelism the head's owners: ``Reducer.owners``; the gradient DDP applies is the ranks'
        mean), so those ranks compute the same alignment, coherence and window state. A second
        collective on monitored steps; every rank runs it, also when its own accumulators failed
        (it then sends NaN)."""
        chains = self.chains
        if reducer is None or not chains:
            return
        size = sum(c.flat_size for c in chains)
        try:
            flat = torch.cat([c.flat() for c in chains])
        except Exception as exc:
            self.on_error("wq_error_chain", exc)
            flat = torch.full((size,), math.nan, dtype=torch.float64, device=chains[0].device)
        reducer.sum_(flat)
        owners = reducer.owners_on(flat.device)  # (every layer's heads,), the reducer's column order
        offset = column = 0
        for layer in self.layers:
            c = layer.chain
            if c is not None:
                c.set_flat(flat[offset: offset + c.flat_size], owners[column: column + layer.total_heads])
                offset += c.flat_size
            column += layer.total_heads

    def state_of(self, layer: Any) -> dict | None:
        """The layer's chain state as CPU tensors (None without a chain). Under tensor parallelism
        every head's, gathered over the tensor-parallel group (one all-reduce: call it on every
        rank of that group, as ``Monitor.state_dict()`` does), so one rank's checkpoint resumes
        every rank."""
        c = layer.chain
        if c is None:
            return None
        state = c.state_dict()
        if c.total_heads == c.num_heads:
            return state
        from .sharded_power import all_reduce_sum

        keys = list(state)
        full = []
        for k in keys:
            t = state[k].double()  # has_prev (bool) and the float32 parts, exactly
            whole = t.new_zeros((c.total_heads, *t.shape[1:]))
            whole[c.head_offset: c.head_offset + c.num_heads] = t
            full.append(whole.to(c.device))
        full = all_reduce_sum(full, layer.placement.heads_group)
        return {k: t.cpu().to(state[k].dtype).clone() for k, t in zip(keys, full)}

    def unscale_(self, inverse_scale: torch.Tensor) -> None:
        """Every fed chain's accumulators of this step divided by the loss scale (``LayerChain.unscale_``)."""
        for c in self.chains:
            if c.fed:
                c.unscale_(inverse_scale)

    def reading(self, layer: Any, window: int) -> torch.Tensor:
        """The layer's readings (len(FIELDS), H) float64 on its statistics' device (NaN without a
        chain); starts the chain's next step. ``window``: ``MonitorConfig.window`` (lam = 1 - 1/window)."""
        return self.readings([layer], window)

    def readings(self, layers: list, window: int) -> torch.Tensor:
        """The readings of ``layers`` side by side, (len(FIELDS), their total heads) float64 on the
        first one's statistics device, NaN where a layer has no chain, its chain failed or its query
        is not W^Q x (``AttentionLayer.query_mismatch``); starts
        each chain's next step. Chains of one shape and device are read together
        (``LayerChain.read_all``)."""
        lam = 1.0 - 1.0 / window
        device = layers[0].stats.device
        groups: dict[tuple, list] = {}
        for layer in layers:
            c = layer.chain
            if c is not None and not layer.query_mismatch:  # a query that is not W^Q x: NaN
                groups.setdefault((c.num_heads, c.head_dim, c.width, c.device), []).append(layer)
        got: dict[int, torch.Tensor] = {}
        for members in groups.values():
            try:
                out = LayerChain.read_all([layer.chain for layer in members], lam)
            except Exception as exc:
                self.on_error("wq_error_chain", exc)
                continue
            for layer, reading in zip(members, out.unbind(0)):
                got[id(layer)] = reading
        parts = [got[id(layer)].to(device) if id(layer) in got else
                 torch.full((len(FIELDS), layer.num_heads), math.nan, dtype=torch.float64, device=device)
                 for layer in layers]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
