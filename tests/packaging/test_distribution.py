"""The distribution ships every Python package of the tree (the product image installs it, not the tree)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_with_an_init_is_in_the_distribution() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for name, where in config["package-dir"].items():
        for init in (REPO / where).rglob("__init__.py"):
            rel = init.parent.relative_to(REPO / where)
            found.add(".".join([name, *rel.parts]))
    # A package left out installs without error and fails only when imported in the image.
    assert found - listed == set(), f"add these to [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed but not in the tree: {sorted(listed - found)}"
