"""Microsoft's RetNet from torchscale 0.3.0 (PyPI), compiled with the backend: parallel,
chunkwise and recurrent retention of ``RetNetDecoder``.

torchscale 0.3.0 normalizes retention in every mode, with no configuration that turns it off:
the parallel form divides the scores by ``|qk.sum(-1)|.clamp(min=1)`` and the decay mask by the
root of its row sums; the chunkwise form divides the intra-chunk scores by
``|qk|.sum(-1).clamp(min=1)`` and the carried state by a clamped maximum of its absolute column
sums, and aligns the two with ``torch.maximum``.

The parallel form is GLA with its normalization around it: the mask's row factor folds into q,
and the scores' row sums are GLA's output for values of ones, so one op call per layer gives both
the product with v and the row sums, the user's abs / clamp / detach kept between them
(``gla_inductor/recognize/forms/normalized.py``): rewritten, logits and gradients as eager. A
normalizer of |A|'s row sums (the chunkwise form's, put into the parallel form here) is no GLA
output and stays code with its reason.

The recurrent form keeps the state divided by the root of a running decay sum read from the
cache: S = S_prev * sqrt(s_prev) * d / sqrt(s) + k v / sqrt(s), s = s_prev * d + 1. That is a GLA
step with the gate log(sqrt(s_prev) * d / sqrt(s)) (a factor provably nonnegative) and the values
scaled by 1 / sqrt(s) (per head), which the decode recognizer rewrites: once per layer in every
step graph that reads a cached state (the first step starts from none). The state is kept V-first
([B, H, V, K]); the op reads it through a transposed view.

The chunkwise form normalizes its intra-chunk scores and its carried state by the data (clamps and
maxima), so its outputs are no GLA output; but the state it carries, S = S * gamma^C + K_i^T (V_i *
gamma^(C-1-c)), is GLA's state at the chunk boundaries, read by that normalization. The chunk-states
form (``gla_inductor/recognize/forms/chunk_states.py``) computes those states at once over the chunk
axis, and leaves the normalization as torchscale wrote it: one rewrite per layer, logits and
gradients as eager, the intra-chunk normalization reported as not GLA.

Installation: torchscale 0.3.0 requires ``timm==0.6.13``, which requires torchvision; next to a
CPU build of torch (CI, the README's install on a CPU machine) pip resolves PyPI's torchvision
0.28.0, whose operators do not register against torch+cpu ("operator torchvision::nms does not
exist"), and ``import timm`` fails. So the ``test`` extra does not list torchscale: the first
run of this module installs ``torchscale==0.3.0`` and ``fairscale==0.4.0`` from the registry,
without dependencies, into a cache folder (``$XDG_CACHE_HOME/gla_inductor/test-packages``; only
those two packages are kept, as fairscale also installs a top-level ``benchmarks``), appended to
sys.path, and later runs reuse it; an installed torchscale 0.3.0 is used as it is. RetNet imports timm only
for ``drop_path`` (stochastic depth), which ``drop_path_rate=0`` never calls: where timm cannot
be imported, its import is answered by a module whose ``drop_path`` raises, for the duration of
the import only. The module is skipped only when the registry cannot be reached.
"""

import contextlib
import importlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from gla_inductor.backend import rewrite

from helpers import rel_err

PACKAGES = ("torchscale==0.3.0", "fairscale==0.4.0")
UNREACHABLE = ("Could not fetch URL", "Failed to establish a new connection", "Network is unreachable",
               "Temporary failure in name resolution", "No matching distribution found", "ConnectionError",
               "Max retries exceeded", "Read timed out")
TOL = 1e-4  # fp32, relative
B, T, CHUNK, LAYERS = 2, 12, 4, 2

pytestmark = pytest.mark.usefixtures("one_thread", "seeded_compiler")


# ---- installation ---------------------------------------------------------------------------------
def _cache_dir() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "gla_inductor" / "test-packages" / "torchscale-0.3.0"


def _install(target: Path) -> None:
    """pip install --no-deps into `target`, once (a temporary folder renamed into place, so an
    interrupted install is not taken for a finished one); skips if the registry is unreachable."""
    if (target / "torchscale").is_dir() and (target / "fairscale").is_dir():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".installing-"))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check",
           "--quiet", "--target", str(tmp), *PACKAGES]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        out = (run.stdout + run.stderr).strip()
        if any(s in out for s in UNREACHABLE):
            pytest.skip(f"torchscale 0.3.0 is not installed and the package registry is unreachable: {out[-300:]}")
        raise RuntimeError(f"pip could not install {' '.join(PACKAGES)}:\n{out[-2000:]}")
    for entry in tmp.iterdir():  # fairscale also installs top-level `benchmarks`, which would shadow ours
        if entry.name.startswith(("torchscale", "fairscale")):
            continue
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _without_timm():
    """While torchscale imports: if timm cannot be imported, a stand-in for
    ``timm.models.layers.drop_path`` that raises (RetNet calls it only with drop_path_rate > 0)."""
    try:
        importlib.import_module("timm.models.layers")
        yield
        return
    except Exception:  # noqa: BLE001 - not installed, or installed against another torch
        pass

    def drop_path(*args, **kwargs):
        raise RuntimeError("timm is not installed: these tests build RetNet with drop_path_rate=0")

    names = ("timm", "timm.models", "timm.models.layers")
    saved = {n: sys.modules.get(n) for n in names}
    layers = types.ModuleType("timm.models.layers")
    layers.drop_path = drop_path
    sys.modules.update({"timm": types.ModuleType("timm"), "timm.models": types.ModuleType("timm.models"),
                        "timm.models.layers": layers})
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


@pytest.fixture(scope="module")
def torchscale():
    """torchscale's RetNet classes: (RetNetConfig, RetNetDecoder)."""
    try:
        version = importlib.metadata.version("torchscale")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if version is None:
        target = _cache_dir()
        _install(target)
        if str(target) not in sys.path:
            sys.path.append(str(target))  # last: nothing there may shadow a module found elsewhere
        importlib.invalidate_caches()
        version = importlib.metadata.version("torchscale")
    if version != "0.3.0":
        pytest.skip(f"these tests read torchscale 0.3.0's code; torchscale {version} is installed")
    with _without_timm():
        from torchscale.architecture.config import RetNetConfig
        from torchscale.architecture.retnet import RetNetDecoder
    return RetNetConfig, RetNetDecoder


# ---- the model ------------------------------------------------------------------------------------
def retnet(torchscale, chunkwise: bool = False):
    RetNetConfig, RetNetDecoder = torchscale
    cfg = RetNetConfig(decoder_embed_dim=32, decoder_value_embed_dim=48, decoder_retention_heads=2,
                       decoder_ffn_embed_dim=64, decoder_layers=LAYERS, vocab_size=64,
                       chunkwise_recurrent=chunkwise, recurrent_chunk_size=CHUNK)
    model = RetNetDecoder(cfg, embed_tokens=torch.nn.Embedding(64, 32))
    with torch.no_grad():  # weights of trained size: xavier at gain 2 ** -2.5 leaves retention faint
        for layer in model.layers:
            for proj in ("q_proj", "k_proj", "v_proj"):
                getattr(layer.retention, proj).weight.normal_(0, 0.5)
    return model.eval()


def compiled(model, results: list):
    def backend(gm, example_inputs):
        results.append(rewrite(gm, example_inputs))
        return gm.forward

    return torch.compile(model, backend=backend, dynamic=False)


def near_misses(results: list, form: str) -> list:
    return [n.reason for r in results for n in r.near_misses if n.form == form]


def check_prefill(model, results: list, rewrites: int = 0) -> None:
    """Logits equal to eager, and the gradients of every parameter under a random weighting."""
    ids = torch.randint(0, 64, (B, T))
    fast = compiled(model, results)
    got, want = fast(ids)[0], model(ids)[0]
    assert rel_err(got, want) <= TOL
    w = torch.randn(want.shape)
    params = [p for p in model.parameters() if p.requires_grad]
    g_got = torch.autograd.grad((got * w).sum(), params)
    g_want = torch.autograd.grad((want * w).sum(), params)
    for p, a, b in zip(params, g_got, g_want):
        assert rel_err(a, b) <= TOL, tuple(p.shape)
    assert counters["gla_inductor"]["rewrites"] == rewrites


def test_no_configuration_turns_the_normalization_off(torchscale):
    """The premise of this module, read off the installed code: every retention mode normalizes,
    unconditionally (no branch on the configuration around it)."""
    import inspect

    from torchscale.component.multiscale_retention import MultiScaleRetention

    parallel = inspect.getsource(MultiScaleRetention.parallel_forward)
    chunkwise = inspect.getsource(MultiScaleRetention.chunk_recurrent_forward)
    recurrent = inspect.getsource(MultiScaleRetention.recurrent_forward)
    assert ".abs().clamp(min=1)" in parallel and "torch.maximum(inner_scale, cross_scale)" in chunkwise
    assert "scale.sqrt()" in recurrent
    assert not any("self.args" in src or "if " in src for src in (parallel, chunkwise))


# ---- parallel -------------------------------------------------------------------------------------
def test_parallel_retention_is_rewritten_and_exact(torchscale):
    """One op per layer, the scores' row sums read from it: logits and every parameter's gradient
    (a training step's) as eager."""
    results = []
    check_prefill(retnet(torchscale), results, rewrites=LAYERS)
    matches = [m for r in results for m in r.matches]
    assert [(m.form, m.gate) for m in matches] == [("parallel", "constant")] * LAYERS
    assert not near_misses(results, "parallel")


def abs_sum_parallel_forward(self, qr, kr, v, mask):
    """torchscale's parallel_forward with the chunkwise form's normalizer: the row sums of |A|."""
    bsz, tgt_len, _ = v.size()
    vr = v.view(bsz, tgt_len, self.num_heads, self.head_dim).transpose(1, 2)
    qk_mat = qr @ kr.transpose(-1, -2) * mask
    qk_mat = qk_mat / qk_mat.detach().abs().sum(dim=-1, keepdim=True).clamp(min=1)
    return torch.matmul(qk_mat, vr).transpose(1, 2)


def test_parallel_retention_normalized_by_absolute_row_sums_is_left_alone(torchscale, monkeypatch):
    from torchscale.component.multiscale_retention import MultiScaleRetention

    monkeypatch.setattr(MultiScaleRetention, "parallel_forward", abs_sum_parallel_forward)
    results = []
    check_prefill(retnet(torchscale), results)
    reasons = near_misses(results, "parallel")
    assert reasons and all("read by abs" in r and "no GLA output" in r for r in reasons), reasons


# ---- chunkwise ------------------------------------------------------------------------------------
def test_chunkwise_retention_states_are_rewritten_and_exact(torchscale):
    """One rewrite per layer (the chunk loop's carried states), logits and every parameter's
    gradient as eager."""
    results = []
    check_prefill(retnet(torchscale, chunkwise=True), results, rewrites=LAYERS)
    matches = [m for r in results for m in r.matches]
    assert [(m.form, m.gate) for m in matches] == [("chunk_states", "constant")] * LAYERS
    assert all(m.options["chunks"] == T // CHUNK for m in matches)
    assert not near_misses(results, "chunk_states")


def test_chunkwise_retention_explain_reports_the_rewrite(torchscale):
    """explain: the states' rewrite at torchscale's line, and the intra-chunk scores' normalization
    left as code with its reason."""
    import gla_inductor

    model = retnet(torchscale, chunkwise=True)
    report = gla_inductor.explain(model, torch.randint(0, 64, (B, T)))
    assert [m.form for m in report.matches] == ["chunk_states"] * LAYERS
    assert all(any("kv_state * cross_decay" in line for line in m.source) for m in report.matches)
    reasons = [n.reason for n in report.near_misses if n.form == "chunked"]
    assert reasons and all("normaliz" in r for r in reasons), reasons


# ---- recurrent ------------------------------------------------------------------------------------
def decode(model, ids):
    """Token by token through torchscale's incremental state: the logits of every step."""
    state, out = {}, []
    for t in range(ids.shape[1]):
        out.append(model(ids[:, : t + 1], incremental_state=state)[0])
    return torch.cat(out, 1)


def test_recurrent_retention_is_rewritten_and_exact(torchscale):
    """Token by token: every step but the first (which starts from no state) is one graph with
    one decode rewrite per layer (every step recompiles: the rotary angle is a Python number
    of the position), and the logits are eager's."""
    model, ids, results = retnet(torchscale), torch.randint(0, 64, (B, T)), []
    with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=2 * T):
        got, want = decode(compiled(model, results), ids), decode(model, ids)
    assert rel_err(got, want) <= TOL
    assert len(results) == T
    assert [len(r.matches) for r in results] == [0] + [LAYERS] * (T - 1)
    assert all(m.form == "decode" and m.options["initial_state"] for r in results for m in r.matches)
    assert counters["gla_inductor"]["rewrites"] == LAYERS * (T - 1)
    assert not near_misses(results, "decode")
