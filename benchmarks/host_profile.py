"""Where the host time of one flashwatch forward+backward call goes (CUDA): cProfile of 200
calls at (1,1,64,64), where the GPU work is a few microseconds, against a bare Triton launch.

    PYTHONPATH=$PWD python3 benchmarks/host_profile.py

The forward+backward line is printed for the ordinary Triton launch and for the cached launch of
``flashwatch.kernels.launch`` (FLASHWATCH_FAST_LAUNCH); the profile runs with the cache on.
"""

import cProfile
import io
import pstats
import sys
import time

import torch
import triton
import triton.language as tl

from flashwatch.kernels import flash_attention, launch


@triton.jit
def _touch(X, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + offs, tl.load(X + offs, mask=offs < n, other=0.0) + 1.0, mask=offs < n)


def per_call_us(fn, calls=500):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> int:
    if not torch.cuda.is_available():
        print("host_profile.py needs CUDA (it times kernel launches)", file=sys.stderr)
        return 2
    x = torch.zeros(1024, device="cuda")
    print(f"bare Triton launch (3 args):       {per_call_us(lambda: _touch[(1,)](x, 1024, BLOCK=1024)):7.1f} us")
    print(f"torch add_ launch:                 {per_call_us(lambda: x.add_(1.0)):7.1f} us")
    q, k, v = (torch.randn(1, 1, 64, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn_like(q)

    def fb():
        torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), g)

    def fwd():
        with torch.no_grad():
            flash_attention(q, k, v, causal=True)

    print(f"flashwatch forward (no grad):      {per_call_us(fwd):7.1f} us")
    for fast in (False, True):
        launch.FAST_LAUNCH = fast
        label = "cached launch" if fast else "ordinary launch"
        print(f"flashwatch forward+backward, {label:16s}{per_call_us(fb):7.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        fb()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue()[-6000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
