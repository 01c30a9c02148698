"""The GPU-only scripts in benchmarks/ say so and exit 2 on a machine without CUDA."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
@pytest.mark.parametrize("script", ["host_overhead.py", "host_profile.py"])
def test_gpu_only_benchmark_scripts_exit_2_and_say_they_need_cuda(script):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "needs CUDA" in proc.stderr
