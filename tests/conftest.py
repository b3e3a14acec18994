import os
import sys

import pytest
import torch

# The spelling zoo (spellings.py) and the shared helpers (helpers.py) live here, above the test
# folders: every folder imports them by name.
sys.path.insert(0, os.path.dirname(__file__))
# helpers.py asserts on behalf of the tests: pytest rewrites its asserts as it does theirs, so a
# failing comparison shows its values
pytest.register_assert_rewrite("helpers")

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


@pytest.fixture(params=["step_loop", "chunked"])
def cpu_impl(request):
    """The test runs once with each CPU implementation of the ops: the C++ step loops
    (gla_inductor/impl/step_loop.py), which the ops take on CPU, and the chunked PyTorch forward and
    backward, which they take for fp64, without a C++ compiler and as the CUDA fallback."""
    from gla_inductor import config

    with config.patch(cpu_kernel=request.param == "step_loop"):
        yield request.param


@pytest.fixture
def chunked_impl():
    """The ops' CPU implementation is the chunked PyTorch one, for tests of that algorithm itself."""
    from gla_inductor import config

    with config.patch(cpu_kernel=False):
        yield


@pytest.fixture(autouse=True)
def no_cost_rule():
    """Tests check what the recognizer proves and that every rewrite is exact, at small shapes where
    the cost rule would leave short steps to Inductor: it is off here, and tested on its own
    (tests/recognize/test_cost_rule.py) with the ``cost_rule`` fixture."""
    from gla_inductor import config

    with config.patch(cost_rule=False):
        yield


@pytest.fixture
def cost_rule():
    from gla_inductor import config

    with config.patch(cost_rule=True):
        yield


@pytest.fixture
def fresh_compiler():
    """Each test compiles from scratch and counts only its own rewrites: Dynamo's caches and
    the counters reset before the test and after it."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def seeded_compiler(fresh_compiler):
    """fresh_compiler, with torch's global generator seeded (0) for tests that draw from it."""
    torch.manual_seed(0)
    yield


@pytest.fixture
def inductor_triton(monkeypatch):
    """Inductor compiles with Triton kernels on whatever device runs the tests (under the
    interpreter on CPU), with fresh caches."""
    import torch._inductor.config  # noqa: F401 - torch does not import Inductor by itself

    patches = dict(fx_graph_cache=False, force_disable_caches=True)
    if not torch.cuda.is_available():
        patches["cpu_backend"] = "triton"
        # exp as tl.exp: the interpreter cannot run libdevice.exp (it returns None)
        if hasattr(torch._inductor.config, "use_fast_math"):
            patches["use_fast_math"] = True
        # A CPU-only Triton has no active driver to hash; the interpreter needs none. Patched where
        # it is defined and wherever a torch version imported the name.
        import torch._inductor.codegen.triton as codegen_triton
        import torch.utils._triton as utils_triton

        for module in (utils_triton, codegen_triton):
            monkeypatch.setattr(module, "triton_hash_with_backend", lambda: "interpreter", raising=False)
    torch._dynamo.reset()
    with torch._inductor.config.patch(patches):
        yield


@pytest.fixture
def fresh_default_config():
    """kconfigs.default_config's cache cleared before the test and after it: for tests that
    patch what it reads (the schedule rule, the SM count), so that no other test is handed their
    choices."""
    from gla_inductor.kernels import chunk as kchunk, configs as kconfigs

    kconfigs.default_config.cache_clear()
    yield
    kconfigs.default_config.cache_clear()


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
