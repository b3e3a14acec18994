import os
import sys

import pytest
import torch

# The spelling zoo and helpers live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU the Triton kernels run under the interpreter, which must be chosen before
# triton is first imported (it swaps in its own versions of triton.language functions).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: intra-op threads only add synchronisation, and on a busy
    2-core runner they made such a module ~2x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


_SUMMARY = pytest.StashKey[list]()


@pytest.fixture
def report_summary(request):
    """add(text): print text and repeat it in the terminal summary, where it shows without -s
    (the fuzzer's program counts)."""
    lines = request.config.stash.setdefault(_SUMMARY, [])

    def add(text: str) -> None:
        print(text)
        lines.append(text)

    return add


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for text in config.stash.get(_SUMMARY, []):
        terminalreporter.write_line(text)


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False, help="run long fuzzing and timing runs")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
