"""The installed package holds every module: pyproject's package list against the source tree."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_is_listed_for_the_wheel():
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed = set(settings["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "attnmt").rglob("__init__.py")}
    missing = sorted(on_disk - listed)
    assert not missing, f"packages missing from pyproject.toml's [tool.setuptools] packages: {missing}"
    assert settings["package-dir"]["attnmt.cli"] == "cli" and "attnmt.cli" in listed
    for package, globs in settings["package-data"].items():
        folder = ROOT / package.replace(".", "/")
        assert all(list(folder.glob(g)) for g in globs), f"{package}: a package-data pattern matches nothing"
