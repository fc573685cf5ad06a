"""Packaging metadata that set-up reads: ``project.license`` is an SPDX expression (a string), not the
TOML table setuptools deprecates (it printed a warning wall twice per venv, at metadata and at build),
and every setuptools the build or the setup scripts ask for understands that form (77 or newer)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))


def test_license_is_an_spdx_string():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"


def _setuptools_floors(text: str) -> list[int]:
    return [int(m) for m in re.findall(r"setuptools>=(\d+)", text)]


def test_every_setuptools_pin_understands_spdx_licenses():
    floors = _setuptools_floors(" ".join(PYPROJECT["build-system"]["requires"]))
    scripts = sorted((REPO / "scripts").glob("setup*.sh"))
    assert len(scripts) >= 4
    for script in scripts:
        found = _setuptools_floors(script.read_text(encoding="utf-8"))
        assert found, f"{script.name} does not pin setuptools"
        floors += found
    assert floors and min(floors) >= 77, floors
