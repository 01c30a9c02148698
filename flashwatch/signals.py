"""Pure statistics of the monitor: drift z, power iteration, windows, growth and trends.

Nothing here knows about models, hooks or alerts. Host-side signals (drift, windows, growth)
run on CPU float64 tensors after a monitored step's single host transfer, so they are cheap
and bit-for-bit reproducible; ``PowerIteration`` runs on the weight's device and returns a
device tensor that joins that transfer.

Definitions (docs/SIGNALS.md), per head, over monitored steps t:

- cumulative coefficient C_T = sum_{t<=T} e_t; drift z_T = C_T / sqrt(sum_{t<=T} e_t^2),
  about N(0, 1) while the sign of e_t is a coin toss, growing like sqrt(T) under a persistent
  sign (z = 0 while every e_t was 0, e.g. under ``fp32_delta``);
- windowed z: the same over the last W monitored steps;
- W^Q spectral norm sigma_h = largest singular value of head h's query rows (D x C);
- growth: sigma_t / sigma_{t-W}; ratio to the layer's median head: sigma_h / median_h(sigma).

Example::

    drift = DriftTracker(num_heads=4, window=50)
    drift.update(torch.tensor([0.1, -0.2, float("nan"), 0.0], dtype=torch.float64))
    drift.z, drift.window_z, drift.cumulative
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["Ring", "host_tensor", "DriftTracker", "drift_z", "PowerIteration", "orthonormalize", "next_vectors", "top_eigenvalue", "top_eigenvector", "spectral_norm_exact", "SigmaHistory",
           "ratio_to_median", "linear_slope"]

_TINY = 1e-30  # keeps divisions defined for an all-zero head (such a head keeps its old vectors)


# The host-side signals are computed with numpy on float64 arrays: a monitored step's host half
# runs a few hundred operations on vectors of a layer's heads, where a numpy operation costs a
# fraction of a torch one's dispatch (docs/PERFORMANCE.md). The torch functions below wrap them.
# Square roots, logarithms and sums over time are left to torch (``_torch``): its vectorised sqrt
# and log and its blocked sums round differently from numpy's in the last bit, and the values
# stay those torch computes.


def _torch(fn, *arrays: np.ndarray) -> np.ndarray:
    """``fn`` applied by torch to float64 arrays (no copies), as an array."""
    return fn(*(torch.from_numpy(a) for a in arrays)).numpy()


def drift_z(cumulative: torch.Tensor, sum_sq: torch.Tensor) -> torch.Tensor:
    """z = C / sqrt(S) per head, 0 where S == 0 (no error seen). Shapes (H,) -> (H,)."""
    return torch.from_numpy(drift_z_array(_f64(cumulative), _f64(sum_sq)))


def drift_z_array(cumulative: np.ndarray, sum_sq: np.ndarray) -> np.ndarray:
    """``drift_z`` on float64 arrays (H,) -> (H,)."""
    seen = sum_sq > 0
    return np.where(seen, cumulative / _torch(torch.sqrt, np.where(seen, sum_sq, 1.0)), 0.0)


def _f64(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a float64 array (a view where it already is one)."""
    return t.detach().to(device="cpu", dtype=torch.float64).numpy()


def host_tensor(saved: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A saved tensor of the host-side state, as this state keeps it: a CPU copy of ``dtype``.

    A checkpoint loaded with ``torch.load(..., map_location="cuda")`` hands the state back on the
    GPU; the host-side trackers add each monitored step's host readings to it, so it must come back
    to the CPU whatever the map_location was.
    """
    return saved.detach().to(device="cpu", dtype=dtype).clone()


class Ring:
    """The last ``length`` rows of a (T, width) float64 series, on the host.

    Args:
        length: rows kept (>= 1).
        width: values per row (e.g. heads).
    """

    def __init__(self, length: int, width: int):
        if length < 1 or width < 1:
            raise ValueError(f"Ring needs length >= 1 and width >= 1, got {length}, {width}")
        self.buffer = torch.zeros(length, width, dtype=torch.float64)
        self.pos = 0  # next row to write
        self.filled = 0  # rows written so far, at most length

    def push(self, row: torch.Tensor) -> None:
        self.buffer[self.pos] = row
        self.pos = (self.pos + 1) % self.buffer.shape[0]
        self.filled = min(self.filled + 1, self.buffer.shape[0])

    def values(self) -> torch.Tensor:
        """Rows in chronological order, oldest first: (filled, width)."""
        if self.filled < self.buffer.shape[0]:
            return self.buffer[: self.filled]
        return torch.cat([self.buffer[self.pos:], self.buffer[: self.pos]])

    @property
    def full(self) -> bool:
        return self.filled == self.buffer.shape[0]

    def state_dict(self) -> dict:
        return {"buffer": self.buffer.clone(), "pos": self.pos, "filled": self.filled}

    def load_state_dict(self, state: dict) -> None:
        if tuple(state["buffer"].shape) != tuple(self.buffer.shape):
            raise ValueError(f"saved window has shape {tuple(state['buffer'].shape)}, this one "
                             f"{tuple(self.buffer.shape)} (another MonitorConfig.window or head count)")
        self.buffer = host_tensor(state["buffer"], torch.float64)
        self.pos, self.filled = int(state["pos"]), int(state["filled"])


class DriftTracker:
    """Cumulative and windowed drift of one layer's signed delta error, per head.

    Args:
        num_heads: H.
        window: W, monitored steps of the windowed z.

    A non-finite e_t of one head is skipped for that head (its sums keep their values; the
    window records 0), so a NaN in one head never poisons the others or the history; ``update``
    returns the mask of finite heads so that the caller can raise the non-finite alert.
    """

    def __init__(self, num_heads: int, window: int):
        self.cumulative = torch.zeros(num_heads, dtype=torch.float64)  # C_T (H,)
        self.sum_sq = torch.zeros(num_heads, dtype=torch.float64)  # sum e_t^2 (H,)
        self.count = torch.zeros(num_heads, dtype=torch.int64)  # finite e_t seen (H,)
        self.ring = Ring(window, num_heads)

    def update(self, e: torch.Tensor) -> torch.Tensor:
        """Add one monitored step's e_t (H,) float64; returns the finite mask (H,) bool."""
        e = e.to(torch.float64)
        finite = torch.isfinite(e)
        e0 = torch.where(finite, e, torch.zeros_like(e))
        self.cumulative += e0
        self.sum_sq += e0 * e0
        self.count += finite.to(torch.int64)
        self.ring.push(e0)
        return finite

    @property
    def z(self) -> torch.Tensor:
        """Cumulative drift z_T (H,)."""
        return drift_z(self.cumulative, self.sum_sq)

    @property
    def window_z(self) -> torch.Tensor:
        """Drift z over the last W monitored steps (H,)."""
        w = self.ring.values()
        return drift_z(_sum_time(w), _sum_time(w * w))

    def state_dict(self) -> dict:
        return {"cumulative": self.cumulative.clone(), "sum_sq": self.sum_sq.clone(), "count": self.count.clone(),
                "ring": self.ring.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["cumulative"].shape != self.cumulative.shape:
            raise ValueError(f"saved drift has {state['cumulative'].shape[0]} heads, this layer "
                             f"{self.cumulative.shape[0]}")
        self.cumulative = host_tensor(state["cumulative"], torch.float64)
        self.sum_sq = host_tensor(state["sum_sq"], torch.float64)
        self.count = host_tensor(state["count"], torch.int64)
        self.ring.load_state_dict(state["ring"])


def spectral_norm_exact(weight: torch.Tensor) -> torch.Tensor:
    """Largest singular value of each head's (D, C) matrix: (H, D, C) -> (H,) float32."""
    return torch.linalg.matrix_norm(weight.detach().float(), ord=2)


def orthonormalize(z: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning z's, per batch entry: (N, C, k) -> (N, C, k), in z's dtype.

    Cholesky QR in float64: R^T R = z^T z, q = z R^-1, the Q of z = Q R with R's diagonal positive
    (the Q Gram-Schmidt gives). A fixed handful of batched operations whatever k (Gram-Schmidt's
    loop over columns launched about 10 k of them, host work on every monitored step), and
    nothing here can make the host wait: ``cholesky_ex`` leaves its failure flag on the device, so
    the monitored step keeps its single host transfer. In float64 q's loss of orthogonality, about
    cond(z)^2 * 2^-53, stays below 1e-4 up to cond(z) = 10^6. A z without k independent columns (a
    zero column, non-finite entries) has no such factor: its q is NaN in every entry.
    """
    z64 = z.double()
    r, info = torch.linalg.cholesky_ex(torch.bmm(z64.transpose(1, 2), z64), upper=True)  # (N, k, k)
    q = torch.linalg.solve_triangular(r, z64, upper=True, left=False)  # q R = z
    # contiguous, as z: the solver returns q column-major, and the vectors' layout decides how later
    # products round (a resumed run, whose vectors come back contiguous, must repeat them bit for bit)
    return torch.where((info == 0)[:, None, None], q, float("nan")).to(z.dtype).contiguous()


def next_vectors(z: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One power-iteration update of the vectors v (N, C, k) from z = W^T W v (N, C, k): z's
    orthonormal basis, except for a head whose basis is not finite, which keeps its v (a masked
    select on the device, no sync), so that one bad step does not poison the next."""
    q = orthonormalize(z)
    ok = torch.isfinite(q).all(dim=2).all(dim=1)
    return torch.where(ok[:, None, None], q, v)


def top_eigenvalue(gram: torch.Tensor, squarings: int = 6) -> torch.Tensor:
    """Largest eigenvalue of each symmetric PSD (k, k) matrix, sync-free: (N, k, k) -> (N,).

    Repeated squaring (gram^(2^squarings), renormalised by its trace each time) turns the matrix
    into (nearly) the projector on its top eigenvector; the Rayleigh quotient of the column with
    the largest diagonal entry then gives the eigenvalue. With 6 squarings an eigenvalue gap of
    10% leaves (0.9)^64 ~ 1e-3 of the second direction, and the quotient's error is quadratic in it.
    """
    return rayleigh_quotient(gram, top_eigenvector(gram, squarings))


def rayleigh_quotient(gram: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """y^T G y / y^T y for each (k, k) matrix G and vector y: (N, k, k), (N, k) -> (N,)."""
    y = vec[..., None]  # (N, k, 1)
    yt = y.transpose(1, 2)
    num = torch.bmm(torch.bmm(yt, gram), y)[:, 0, 0]
    den = torch.bmm(yt, y)[:, 0, 0].clamp_min(_TINY)
    return num / den


def top_eigenvector(gram: torch.Tensor, squarings: int = 6) -> torch.Tensor:
    """A unit vector of the top eigenspace of each symmetric PSD (k, k) matrix, sync-free:
    (N, k, k) -> (N, k), in gram's dtype (a zero matrix gives a zero vector). Repeated squaring as in
    ``top_eigenvalue``, in float64 and scaled once (trace 1, so every eigenvalue lies in [0, 1] and
    the top one is >= 1/k; after s squarings >= k^-(2^s), 2^-448 at k = 128 and s = 6: no underflow
    in float64); the column with the largest diagonal entry of gram^(2^squarings), normalised."""
    k = gram.shape[-1]
    if k == 1:
        return torch.ones(gram.shape[:-1], dtype=gram.dtype, device=gram.device)
    a = gram.double()
    a = a / a.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(_TINY)[..., None, None]
    for _ in range(squarings):
        a = torch.bmm(a, a)
    j = a.diagonal(dim1=-2, dim2=-1).argmax(-1)  # (N,)
    col = torch.gather(a, 2, j[:, None, None].expand(-1, k, 1))[..., 0]
    return (col / col.norm(dim=-1, keepdim=True).clamp_min(1e-300)).to(gram.dtype)


def _fused(weight: torch.Tensor, v: torch.Tensor, iters: int) -> bool:
    """Whether the power step runs as one kernel (``flashwatch.kernels.power``) for these tensors."""
    from .kernels import uses_triton

    if not uses_triton(weight.device):
        return False
    from .kernels import power

    return power.supports(weight, v, iters)


class PowerIteration:
    """Largest singular value of every head's W^Q by block power iteration, batched over heads.

    Args:
        weight: (N, D, C): N heads (of one layer, or several layers stacked), each a
            d_head x d_model query weight.
        block: k, vectors kept per head (subspace iteration). k = 1 is classic power iteration.
            Why 4 by default: early in training a head's top singular values are close and their
            directions turn quickly, which a single vector follows badly (docs/CALIBRATION.md).
        seed: ``"svd"``: start from each head's exact top-k right singular vectors (one batched
            SVD at attach), so the estimate is exact at the start; ``"random"``: a fixed-seed
            random start.

    Persistent state: ``v`` (N, C, k) float32 on the weight's device. Each iteration is
    V <- orthonormalize(W^T W V); the estimate is the Rayleigh-Ritz value sqrt(lambda_max((W V)^T
    (W V))), never above the true sigma_max. A head whose iteration is non-finite keeps its
    previous vectors (a masked select on the device, no sync), so one bad step does not
    poison the next; its sigma is reported as computed (NaN) for the non-finite rule.
    """

    def __init__(self, weight: torch.Tensor, block: int = 4, seed: str = "svd"):
        if weight.dim() != 3:
            raise ValueError(f"weight must be (heads, head_dim, model_dim), got shape {tuple(weight.shape)}")
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be an int >= 1, got {block!r}")
        w = weight.detach().float()
        k = min(block, w.shape[1], w.shape[2])
        self._top = None  # (v, top eigenvector) of the last step, for top_in_block
        self._pair = None  # (v, (u, v_top)) where the last step's kernel also made the top pairs, for made_pair
        with torch.no_grad():
            if seed == "svd":
                _, s, vh = torch.linalg.svd(w, full_matrices=False)  # s (N, r), vh (N, r, C)
                self.v = vh[:, :k, :].transpose(1, 2).contiguous()  # (N, C, k)
                self.sigma = s[:, 0].contiguous()
            elif seed == "random":
                g = torch.Generator().manual_seed(0)
                v = torch.randn(w.shape[0], w.shape[2], k, generator=g, dtype=torch.float32).to(w.device)
                self.v = orthonormalize(v)
                self.sigma = torch.zeros(w.shape[0], device=w.device)
            else:
                raise ValueError(f"seed must be 'svd' or 'random', got {seed!r}")

    @torch.no_grad()
    def step(self, weight: torch.Tensor, iters: int = 1, pair: bool = False) -> torch.Tensor:
        """Run ``iters`` iterations on the current weight; returns sigma (N,) float32 on the device.

        Where Triton runs (CUDA), one kernel does the whole step (``flashwatch.kernels.power``,
        the same computation to FP32 rounding); with ``pair`` it also makes the top singular
        pairs, which ``made_pair`` then returns."""
        self._top = self._pair = None
        w = weight.detach()
        if self.v.device != w.device:
            self.v, self.sigma = self.v.to(w.device), self.sigma.to(w.device)
        if _fused(w, self.v, iters):
            from .kernels import power

            self.v, self.sigma, top, made = power.power_step(w, self.v, iters, pair=pair)
            self._top = (self.v, top)
            self._pair = (self.v, made) if made is not None else None
            return self.sigma
        w = w.float()
        v = self.v
        for _ in range(iters):
            v = next_vectors(torch.bmm(w.transpose(1, 2), torch.bmm(w, v)), v)  # (N, C, k)
        y = torch.bmm(w, v)  # (N, D, k)
        self.v = v
        gram = torch.bmm(y.transpose(1, 2), y)
        top = top_eigenvector(gram)  # (N, k)
        self._top = (v, top)
        self.sigma = rayleigh_quotient(gram, top).clamp_min(0).sqrt()
        return self.sigma

    def made_pair(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The top singular pairs (u (N, D), v (N, C)) the last ``step(pair=True)`` made in its kernel
        (what ``chain.top_pair`` computes from the weight and these vectors); None where it made none
        or ``v`` changed since."""
        return self._pair[1] if self._pair is not None and self._pair[0] is self.v else None

    def top_in_block(self) -> torch.Tensor | None:
        """The last ``step``'s top eigenvector of (W V)^T (W V), (N, k), for the current ``v``
        (the top singular pair's coordinates in the block: ``chain.top_pair``); None when ``v``
        changed since (a restart, a load) or no step ran."""
        return self._top[1] if self._top is not None and self._top[0] is self.v else None

    @torch.no_grad()
    def exact(self, weight: torch.Tensor) -> torch.Tensor:
        """Exact sigma (N,) by SVD, and restart the vectors from it (on request; syncs on CUDA)."""
        fresh = PowerIteration(weight, block=self.v.shape[-1], seed="svd")
        ok = torch.isfinite(fresh.v).all(dim=2).all(dim=1)
        self.v = torch.where(ok[:, None, None], fresh.v, self.v.to(fresh.v.device))
        self.sigma = fresh.sigma
        return self.sigma

    def state_dict(self) -> dict:
        return {"v": self.v.detach().cpu().clone(), "sigma": self.sigma.detach().cpu().clone()}

    def check_state(self, state: dict) -> None:
        """Raise ValueError unless ``state`` (``state_dict()``) fits these vectors."""
        if tuple(state["v"].shape) != tuple(self.v.shape) or tuple(state["sigma"].shape) != tuple(self.sigma.shape):
            raise ValueError(f"saved power-iteration vectors have shape {tuple(state['v'].shape)}, this "
                             f"layer needs {tuple(self.v.shape)} (heads, model width, vectors per head)")

    def load_state_dict(self, state: dict) -> None:
        self.check_state(state)
        self.v = state["v"].to(device=self.v.device, dtype=torch.float32).clone()
        self.sigma = state["sigma"].to(device=self.v.device, dtype=torch.float32).clone()


class SigmaHistory:
    """The last W+1 spectral norms of a layer's heads, for growth over a window (host).

    ``growth`` is sigma_t / sigma_{t-W} once W+1 monitored steps were seen, NaN before.
    """

    def __init__(self, num_heads: int, window: int):
        self.window = window
        self.ring = Ring(window + 1, num_heads)

    def update(self, sigma: torch.Tensor) -> None:
        self.ring.push(sigma.to(torch.float64))

    @property
    def growth(self) -> torch.Tensor:
        values = self.ring.values()
        if not self.ring.full:
            return torch.full((values.shape[1],), float("nan"), dtype=torch.float64)
        return values[-1] / values[0]

    def state_dict(self) -> dict:
        return {"ring": self.ring.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.ring.load_state_dict(state["ring"])


def ratio_to_median(sigma: torch.Tensor) -> torch.Tensor:
    """Each head's value over the median of its layer's heads (H,) -> (H,).

    The median of an even number of heads is the mean of the two middle ones; non-finite
    heads are left out of the median (and get a non-finite ratio).
    """
    return torch.from_numpy(ratio_to_median_array(_f64(sigma)))


def ratio_to_median_array(x: np.ndarray) -> np.ndarray:
    """``ratio_to_median`` on float64 arrays: (..., H) -> (..., H), each row over its own median."""
    if x.ndim > 1:
        if np.isfinite(x).all():  # the usual case, in one sort
            return _over_median(x, np.sort(x, axis=-1))
        return np.stack([ratio_to_median_array(row) for row in x.reshape(-1, x.shape[-1])]).reshape(x.shape)
    return _over_median(x, np.sort(x[np.isfinite(x)]))


def _over_median(x: np.ndarray, finite_sorted: np.ndarray) -> np.ndarray:
    """x (..., H) over the median of finite_sorted (..., n) along the last axis; NaN where it is
    not > 0 or n == 0."""
    n = finite_sorted.shape[-1]
    if n == 0:
        return np.full(x.shape, np.nan)
    # the median as torch.quantile(q=0.5) computes it: a linear interpolation (torch.lerp's
    # formula) between the two middle values, weight 0.5 for an even count
    lo, hi = finite_sorted[..., (n - 1) // 2], finite_sorted[..., n // 2]
    med = lo if n % 2 else hi - (hi - lo) * 0.5
    med = np.asarray(med)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(med > 0, x / np.where(med > 0, med, 1.0), np.nan)


def linear_slope(series: torch.Tensor) -> torch.Tensor:
    """Least-squares slope per column of a (T, H) series, in units per monitored step (H,).

    NaN for T < 2. A trend helper for reports and exporters (e.g. "max logit rising by 2 per
    monitored step").
    """
    return torch.from_numpy(linear_slope_array(_f64(series)))


def linear_slope_array(y: np.ndarray) -> np.ndarray:
    """``linear_slope`` on float64 arrays: (..., T, H) -> (..., H), each (T, H) series alone
    (batched series give the same values as one at a time)."""
    t = y.shape[-2]
    if t < 2:
        return np.full(y.shape[:-2] + y.shape[-1:], np.nan)
    x = np.arange(t, dtype=np.float64) - (t - 1) / 2.0
    centred = y - _torch(lambda v: v.mean(-2, keepdim=True), y)
    return _torch(_sum_time, x[:, None] * centred) / _torch(torch.sum, x * x)


def _sum_time(t: torch.Tensor) -> torch.Tensor:
    """Sum over the time axis of (..., T, H) series."""
    return t.sum(-2)
