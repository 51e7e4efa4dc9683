"""Every worked example in a docstring runs: the losses' executed examples, the benchmark's and
the study's small helpers."""

import doctest
import importlib

import pytest

MODULES = [
    "common",
    "grpo",
    "dapo",
    "tepo",
    "erpo",
    "sapo",
    "eval",
    "tools.bench",
    "tools.cost",
    "tools.study",
    "tools.study_real",
    "tools.same_metrics",
    "tools.make_data",
]
WITH_EXAMPLES = {
    "common",
    "grpo",
    "dapo",
    "tepo",
    "erpo",
    "sapo",
    "tools.bench",
    "tools.cost",
    "tools.study",
    "tools.study_real",
    "tools.same_metrics",
}


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0
    assert result.attempted > 0 or name not in WITH_EXAMPLES
