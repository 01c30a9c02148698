"""Shared fixtures. Tests run on the CPU by default; tests marked ``gpu`` skip without CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The repository root goes last on the path: tests import research/ and benchmarks/ from the checkout
# (they are not installed), but its top-level kernels/ folder must not shadow an installed package of
# that name (Hugging Face's `kernels`, which transformers requires and imports). `python -m pytest`
# puts the working directory first; it is moved to the end.
_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [p for p in sys.path if p not in ("", _ROOT) and os.path.abspath(p) != _ROOT] + [_ROOT]

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton jits its own library (tl.zeros, ...) when triton.language is first imported, as
    # interpreted functions only if TRITON_INTERPRET=1 then. Import it so now, before any
    # test module imports triton, so the interpreted kernel tests work in any test order. The
    # variable is unset again: CPU tensors keep dispatching to the PyTorch reference.
    _old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        if _old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _old


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0


@pytest.fixture(scope="session")
def triton_interpreter():
    """flashwatch.kernels.triton_attn (the launchers) with its kernels (``.triton_kernels``) built
    for Triton's CPU interpreter.

    Triton decides at decoration time whether a kernel is interpreted, so the kernels' modules are
    (re)imported with TRITON_INTERPRET=1, then the launchers' (they bind the kernels at import).
    Skipped where CUDA exists (the GPU tests run the compiled kernels there) or Triton is missing.
    """
    import importlib

    if torch.cuda.is_available():
        pytest.skip("CUDA present: the compiled kernels are tested by the gpu tests")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton: its own library is jitted then
    try:
        pytest.importorskip("triton")
        from flashwatch.kernels import chain_reading, chain_sums, hopper, power, triton_attn, triton_kernels

        interpreted = lambda f: type(f).__name__ == "InterpretedFunction"
        if not interpreted(chain_sums._subtract_push_kernel):
            importlib.reload(chain_sums)  # its callers (rows, flashwatch.chain) read it through the module
        if not interpreted(power._power_kernel):
            importlib.reload(power)  # flashwatch.signals reads it through the module
        if not interpreted(chain_reading._read_chains_kernel):
            importlib.reload(chain_reading)  # flashwatch.chain imports read_chains at each reading
        if not (interpreted(triton_kernels._attn_fwd_kernel) and interpreted(hopper._query_program)):
            # the kernels' module first, then the modules that import its jitted helpers by name
            # (hopper: a stale compiled helper there cannot be called from an interpreted kernel)
            importlib.reload(triton_kernels)
            importlib.reload(hopper)
            triton_attn = importlib.reload(triton_attn)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old
    return triton_attn


@pytest.fixture
def interpret_dispatch(triton_interpreter, monkeypatch):
    """Route CPU tensors of flashwatch.kernels.flash_attention to the interpreted kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return triton_interpreter


@pytest.fixture
def interpreted_on_cpu(request, device):
    """For a test parametrized by ``device``: Triton kernels interpreted where it is ``"cpu"`` (CPU
    tensors routed to them, ``interpret_dispatch``), compiled where it is ``"cuda"``."""
    if device == "cpu":
        request.getfixturevalue("interpret_dispatch")


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters cleared before and after a test that compiles (graph counts and
    recompiles read per test)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
