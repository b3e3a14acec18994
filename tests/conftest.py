import os
import sys

# The spelling zoo and helpers live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="run long fuzzing and timing runs")


def pytest_collection_modifyitems(config, items):
    import pytest

    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
