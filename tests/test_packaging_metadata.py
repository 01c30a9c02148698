"""pyproject.toml declares what the package imports, and says its license the way setuptools
will keep accepting (an SPDX expression, not the TOML table deprecated for 2027)."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = (ROOT / "flashwatch", ROOT / "kernels")  # what the wheel installs


def _dist_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _imports() -> dict[str, set[pathlib.Path]]:
    """Top-level module -> files of the package that import it (absolute imports only)."""
    out: dict[str, set[pathlib.Path]] = {}
    for folder in PACKAGE_DIRS:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    out.setdefault(name.split(".")[0], set()).add(path)
    return out


def test_every_third_party_import_is_declared():
    declared_core = {_dist_name(r) for r in PYPROJECT["project"]["dependencies"]}
    declared = declared_core | {_dist_name(r) for extra in PYPROJECT["project"]["optional-dependencies"].values()
                                for r in extra}
    by_module = importlib.metadata.packages_distributions()
    missing = {}
    for module, files in _imports().items():
        if module in sys.stdlib_module_names or module in ("flashwatch", "kernels", "_pytest"):
            continue
        dists = {d.lower().replace("_", "-") for d in by_module.get(module, [module])}
        if not dists & declared:
            missing[module] = sorted(str(f.relative_to(ROOT)) for f in files)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    assert "numpy" in declared_core, "flashwatch.replay imports numpy at module level: a core dependency"


def test_license_is_an_spdx_expression_without_a_setuptools_deprecation():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"  # a string, not {text = ...}
    setuptools = pytest.importorskip("setuptools")
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (77, 0):
        pytest.skip("setuptools < 77 does not read SPDX license expressions")
    assert any(r.startswith("setuptools>=") and int(r.split(">=")[1].split(".")[0]) >= 77
               for r in PYPROJECT["build-system"]["requires"])
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    deprecations = [str(w.message).splitlines()[0] for w in caught if "Deprecat" in w.category.__name__]
    assert not deprecations, deprecations
    assert dist.metadata.license_expression == "Apache-2.0"
