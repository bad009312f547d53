"""The examples in module docstrings are part of the documentation: they must stay true."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "ciuic_doctor.units",
    "ciuic_doctor.store",
    "ciuic_doctor.envinfo",
    "ciuic_doctor.findings",
    "ciuic_doctor.jobs.spec",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0, f"{name} lost its examples"
    assert result.failed == 0
