"""The examples in docstrings are part of the documentation: every one of them must stay true."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import ciuic_doctor


def _modules_with_examples() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(ciuic_doctor.__path__, prefix="ciuic_doctor."):
        spec = importlib.util.find_spec(info.name)
        if spec and spec.origin and spec.origin.endswith(".py"):
            with open(spec.origin, encoding="utf-8") as fh:
                if ">>> " in fh.read():
                    names.append(info.name)
    return sorted(names)


MODULES = _modules_with_examples()


def test_examples_are_found():
    assert "ciuic_doctor.units" in MODULES
    assert "ciuic_doctor.jobs.spec" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0, f"{name} lost its examples"
    assert result.failed == 0
