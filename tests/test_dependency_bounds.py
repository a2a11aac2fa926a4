"""The dependency bounds say what has been run: pyproject.toml's lower bound of
transformers is the release .ci/oldest.txt pins (CI runs the model families there), and
every installed dependency of dtree lies within pyproject.toml's bounds (a test run on
packages outside them would prove nothing about what users install)."""

from __future__ import annotations

import pathlib
import re
import tomllib
from importlib import metadata

from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).parent.parent


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(line) for line in lines]


def test_oldest_pins_are_the_lower_bounds():
    pins = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = re.fullmatch(r"([\w.-]+)==([\w.]+)", line).groups()
            pins[name] = version
    lower = {
        r.name: s.version for r in _requirements() for s in r.specifier if s.operator == ">=" and r.name in pins
    }
    assert lower == pins, f"pyproject.toml's lower bounds {lower} differ from .ci/oldest.txt {pins}"


def test_installed_dependencies_are_within_bounds():
    for extra in (None, "test", "verl"):
        for req in _requirements(extra):
            if req.marker is not None and not req.marker.evaluate():
                continue
            try:
                installed = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                if extra == "verl":  # an optional extra: checked where it is installed (CI's oldest stage)
                    continue
                raise
            # a local build tag (torch's "+cpu") is not part of the release
            assert req.specifier.contains(installed.split("+")[0], prereleases=True), (
                f"{req.name} {installed} is outside pyproject.toml's bounds {req.specifier}"
            )


def test_every_dependency_has_an_upper_bound():
    for extra in (None, "test", "trl", "fused", "flash", "triton", "verl", "hybrid"):
        for req in _requirements(extra):
            operators = {s.operator for s in req.specifier}
            assert operators & {"<", "<=", "=="}, f"{req.name} ({extra or 'core'}) has no upper bound: {req.specifier}"
