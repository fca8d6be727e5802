"""The package layout: stage packages, and the Model Garden's module names."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
from conftest import ROOT

import recommendation


@pytest.mark.parametrize("name", sorted(recommendation.MODEL_GARDEN_MODULES))
def test_a_model_garden_module_name_imports_the_module_that_holds_its_code(name):
    held = importlib.import_module(recommendation.MODEL_GARDEN_MODULES[name])
    assert importlib.import_module(f"recommendation.{name}") is held
    assert getattr(recommendation, name) is held


@pytest.mark.integration
def test_the_model_garden_names_work_in_from_imports_and_nothing_else_is_invented():
    code = (
        "from recommendation import neumf_model, ncf_common, data_pipeline\n"
        "import recommendation.stat_utils as stat_utils\n"
        "print(neumf_model.__name__, ncf_common.__name__, data_pipeline.__name__, "
        "stat_utils.__name__)\n"
        "try:\n"
        "    import recommendation.ncf_keras_main\n"
        "except ModuleNotFoundError as error:\n"
        "    print(error)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.splitlines() == [
        "recommendation.model.neumf_model recommendation.training.ncf_common "
        "recommendation.producer.data_pipeline recommendation.producer.stat_utils",
        "No module named 'recommendation.ncf_keras_main'",
    ]


def test_the_architecture_page_names_every_module():
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as page:
        text = page.read()
    modules = [
        os.path.relpath(os.path.join(folder, name), ROOT)
        for package in ("recommendation", "official")
        for folder, _, names in os.walk(os.path.join(ROOT, package))
        for name in names
        if name.endswith(".py") and name != "__init__.py"
    ]
    assert len(modules) >= 50
    assert [module for module in modules if f"`{module}`" not in text] == []
