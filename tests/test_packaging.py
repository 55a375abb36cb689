"""What `pip install .` installs (the Dockerfile's install, and a user's): every package and
subpackage of the tree, found by setuptools' own discovery from pyproject.toml's settings.

An explicit package list once installed only the top-level packages (no shared.model, no
kernels.fused): the editable install the tests run from hid it, the image could not serve."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parent.parent


def tree_packages() -> set[str]:
    """Every folder of Python modules under the services' packages and protos/: its dotted name."""
    found = set()
    for where, tops in ((ROOT, ("kernels", "shared", "drafter_service", "verifier_service", "gateway_service")),
                        (ROOT / "protos", ("tandem",))):
        for top in tops:
            for module in (where / top).rglob("*.py"):
                if "__pycache__" not in module.parts:
                    found.add(".".join(module.parent.relative_to(where).parts))
    return found


def test_every_package_of_the_tree_is_installed():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    installed = {package for where in find["where"]
                 for package in find_packages(where=str(ROOT / where), include=find["include"])}
    expected = tree_packages()
    assert {"shared.model.families.hybrid", "kernels.fused", "verifier_service.governor", "tandem.v1"} <= expected
    assert expected - installed == set(), "folders of modules that `pip install .` would leave out (an __init__.py missing?)"
    assert installed - expected == set()
