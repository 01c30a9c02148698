"""A non-editable `pip install .` into a fresh venv installs flashwatch.kernels and no
top-level `kernels` module (that name belongs to another PyPI package)."""

from __future__ import annotations

import os
import pathlib
import site
import subprocess
import sys
import venv

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_non_editable_install_layout(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    purelib = subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                      text=True).strip()
    # The dependencies (torch, ...) come from the test environment; flashwatch itself does not.
    pathlib.Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-warn-script-location", str(ROOT)],
                   check=True, env=env, cwd=tmp_path)
    installed = pathlib.Path(purelib)
    assert (installed / "flashwatch" / "kernels" / "__init__.py").is_file()
    assert (installed / "flashwatch" / "kernels" / "reference.py").is_file()
    for sub in ("exporters", "experiments"):
        assert (installed / "flashwatch" / sub / "__init__.py").is_file(), f"flashwatch.{sub} not installed"
    assert not (installed / "kernels").exists(), "a top-level `kernels` package was installed"
    code = ("import flashwatch, flashwatch.kernels as k; "
            "assert 'site-packages' in k.__file__, k.__file__; "
            "import importlib.util as u; assert u.find_spec('kernels') is None; "
            "print(k.VARIANTS)")
    out = subprocess.run([py, "-c", code], check=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert "fp32_delta" in out.stdout
    assert (env_dir / "bin" / "flashwatch").exists(), "console script `flashwatch` missing"
