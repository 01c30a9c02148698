"""A non-editable `pip install .` into a fresh venv installs flashwatch.kernels and no
top-level `kernels` module (that name belongs to another PyPI package), and none of the
research harness (research/: experiments, bias lab, GPU scripts), which runs from a checkout."""

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
    for sub in ("exporters", "replay"):
        assert (installed / "flashwatch" / sub / "__init__.py").is_file(), f"flashwatch.{sub} not installed"
    assert not (installed / "kernels").exists(), "a top-level `kernels` package was installed"
    # what the wheel installed, as its RECORD lists it: the product, no research code, no scripts
    (record,) = installed.glob("flashwatch-*.dist-info/RECORD")
    files = [line.split(",")[0] for line in record.read_text().splitlines() if line]
    research = [f for f in files if f.startswith(("research/", "flashwatch/experiments/"))
                or f.endswith((".sh", "/lab.py", "/worker.py", "/runner.py", "/scenarios.py", "/figures.py"))]
    assert not research, f"research code or scripts in the wheel: {research}"
    assert "flashwatch/replay/cli.py" in files and "flashwatch/replay/records.py" in files
    assert not [f for f in files if f.startswith("kernels/")], "the wheel installs a top-level `kernels` package"
    # a `kernels` found now is another distribution's (Hugging Face's, which transformers requires), from the
    # test environment's site-packages, never one this install put in its own
    code = ("import flashwatch, flashwatch.kernels as k; "
            "assert 'site-packages' in k.__file__, k.__file__; "
            f"import importlib.util as u; s = u.find_spec('kernels'); assert s is None or not s.origin.startswith({str(installed)!r}), s; "
            "assert u.find_spec('research') is None; "
            "print(k.VARIANTS)")
    out = subprocess.run([py, "-c", code], check=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert "fp32_delta" in out.stdout
    assert (env_dir / "bin" / "flashwatch").exists(), "console script `flashwatch` missing"


def test_the_checkouts_scripts_put_it_after_the_installed_packages():
    """The dashboard builders and the DDP demo add the checkout to the path when run from it: after the
    installed packages, so that its kernels/ folder never shadows an installed `kernels` (Hugging Face's,
    which transformers imports; once shadowed, every model of transformers failed to import)."""
    import importlib.util

    sites = [str(pathlib.Path(p).resolve()) for p in site.getsitepackages()]
    for script in ("dashboards/build_alerts.py", "dashboards/build_dashboard.py"):
        spec = importlib.util.spec_from_file_location(f"_path_check_{pathlib.Path(script).stem}", ROOT / script)
        before = list(sys.path)
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            resolved = [str(pathlib.Path(p).resolve()) if p else os.getcwd() for p in sys.path]
            last_site = max(resolved.index(s) for s in sites if s in resolved)
            assert all(i > last_site for i, p in enumerate(resolved) if p == str(ROOT)), (script, sys.path[:6])
        finally:
            sys.path[:] = before
