"""A chunked run cut in two around an exchange of states (``kernels.parts``, the ops
``chunk_sums``, ``chunk_fwd_from_parts``, ``chunk_bwd_from_parts``), under the Triton interpreter:
the first half's folded state and decay equal the time loop's (float64 reference), and the second
half from the parts equals the whole ``chunk_fwd`` / ``chunk_bwd`` on the same kernels, for the
gates whose schedule is the local one, reverse, grouped heads and chunk edges; the fakes' shapes;
a clear error where the cut does not apply."""

import dataclasses

import pytest
import torch

import final_state_cases as cases
from gla_inductor.contract import GLACall
from gla_inductor.kernels import parts as parts_kernels
from gla_inductor.ops import dispatch
from gla_inductor.ops import parts as ops  # noqa: F401  (registers the ops)

triton = pytest.importorskip("triton")
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
INTERPRETED = type(triton.language.cumsum).__name__ == "InterpretedFunction"
pytestmark = pytest.mark.skipif(not (ON_GPU or INTERPRETED), reason="needs a GPU or TRITON_INTERPRET=1")

gla = torch.ops.gla_inductor

# the local schedule: vector gates (fused ones too) from K = 64, the other gates at K = 256
SHAPES = {"vector": dict(K=64), "logsigmoid": dict(K=64), "softplus": dict(K=64), "gamma": dict(K=256, V=8),
          "none": dict(K=256, V=8)}


def _inputs(gate: str, T: int = 100, dtype=torch.float32) -> dict:
    """On the test device (``_reference`` runs the float64 time loop on CPU)."""
    # q and k grouped (one head for v's two) with the plain vector gate
    t = cases.inputs(gate, B=1, T=T, H=2, G=1 if gate == "vector" else 2, dtype=dtype, **{"V": 16, **SHAPES[gate]})
    return {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in t.items()}


def _reference(t: dict, dual: bool):
    return cases.reference({n: x.cpu() if isinstance(x, torch.Tensor) else x for n, x in t.items()}, dual)


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _fwd_args(t: dict, h0: torch.Tensor) -> tuple:
    return (t["q"], t["k"], t["v"], t["g"], t["g_gamma"], h0, t["scale"], True, t["reverse"], t["gate_fn"], 1.0,
            None, None, t["gate_a"], t["gate_bias"])


def _bwd_args(t: dict, h0: torch.Tensor, dht: torch.Tensor) -> tuple:
    return (t["q"], t["k"], t["v"], t["g"], t["g_gamma"], h0, t["do"], dht, t["scale"], t["reverse"], t["gate_fn"],
            1.0, None, None, t["gate_a"], t["gate_bias"])


def _close(got: torch.Tensor, want: torch.Tensor, name: str, rtol: float = 1e-5):
    assert got.shape == want.shape, f"{name}: {got.shape} != {want.shape}"
    if want.numel():
        got, want = got.double().cpu(), want.double().cpu()
        err = (got - want).abs().max().item()
        assert err <= rtol * max(1.0, want.abs().max().item()), f"{name}: max error {err}"


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("gate", list(SHAPES))
def test_halves_equal_the_whole(gate, reverse):
    t = dict(_inputs(gate), reverse=reverse)
    H, K, V = t["v"].shape[2], t["q"].shape[-1], t["v"].shape[-1]
    h0, dht = _randn(1, H, K, V, seed=3), _randn(1, H, K, V, seed=4)

    for dual in (False, True):
        S, D, *parts = gla.chunk_sums(*cases.op_args(t, dual))
        want_S, want_D = _reference(t, dual)
        _close(S, want_S, f"S (dual={dual})")
        if not dual:
            _close(D, want_D, "D")
        if dual:
            grads = gla.chunk_bwd_from_parts(parts, *_bwd_args(t, h0, dht))
            whole = gla.chunk_bwd(*_bwd_args(t, h0, dht))
            for name, got, want in zip(("dq", "dk", "dv", "dg", "dg_gamma", "dh0"), grads, whole):
                _close(got, want, name)
        else:
            got = gla.chunk_fwd_from_parts(parts, *_fwd_args(t, h0))
            whole = dispatch.chunk_fwd_gpu(GLACall.from_op_args(_fwd_args(t, h0)))  # the kernels, not the step loop
            for name, g, w in zip(("o", "ht"), got, whole):
                _close(g, w, name)


@pytest.mark.parametrize("T", [0, 1, 63, 64, 65, 200])
def test_chunk_edges(T):
    """Around the chunk length (64), no steps at all, and more segments than chunks (at least two
    segments walk: with one chunk the second segment is empty, its sums zeros and its decay 1)."""
    t = _inputs("vector", T=T)
    h0 = _randn(1, 2, 64, 16, seed=4)
    S, D, *parts = gla.chunk_sums(*cases.op_args(t, False))
    want_S, want_D = _reference(t, False)
    _close(S, want_S, "S")
    _close(D, want_D if T else torch.ones_like(D), "D")
    o, ht = gla.chunk_fwd_from_parts(parts, *_fwd_args(t, h0))
    want_o, want_ht = dispatch.chunk_fwd_gpu(GLACall.from_op_args(_fwd_args(t, h0)))
    _close(o, want_o, "o")
    _close(ht, want_ht, "ht")


@pytest.mark.parametrize("gate", ["vector", "none"])
def test_opcheck(gate):
    """Schemas, and fakes whose shapes, dtypes and strides are the real outputs'."""
    t = _inputs(gate, T=70)
    H, K, V = t["v"].shape[2], t["q"].shape[-1], t["v"].shape[-1]
    h0 = _randn(1, H, K, V, seed=5)
    for dual in (False, True):
        args = cases.op_args(t, dual)
        torch.library.opcheck(gla.chunk_sums.default, args, test_utils=("test_schema", "test_faketensor"))
        parts = list(gla.chunk_sums(*args)[2:])
        op, rest = (gla.chunk_bwd_from_parts, _bwd_args(t, h0, h0)) if dual else (gla.chunk_fwd_from_parts,
                                                                                   _fwd_args(t, h0))
        torch.library.opcheck(op.default, (parts, *rest), test_utils=("test_schema", "test_faketensor"))


def test_config_walks_in_segments():
    """Both halves run one config, with at least two segments (one launch's sums, then the walk),
    each segment's sums in one piece: the parts' hs holds one state per segment, whatever pieces the
    call's own (terms carry) config cut its sums into."""
    call = GLACall.from_op_args(_fwd_args(_inputs("vector"), None))
    assert parts_kernels.config(call).segments >= 2 and parts_kernels.config(call).local
    terms = dataclasses.replace(parts_kernels.config(call), local=False, terms=True, segments=4, sum_splits=2)
    assert parts_kernels.cut(terms).sum_splits == 1 and parts_kernels.cut(terms).segments == 4


def test_error_where_the_cut_does_not_apply():
    t = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # K < 64: the fused schedule
         for n, x in cases.inputs("vector", K=8, T=20, dtype=torch.float32).items()}
    assert not dispatch.chunk_parts_apply(GLACall.from_op_args(_fwd_args(t, None)))
    with pytest.raises(ValueError, match="run the chunked kernels' local schedule only"):
        gla.chunk_sums(*cases.op_args(t, False))


def _compiled_halves(t: dict, dual: bool):
    """chunk_sums, then the second half from its parts, entering with S (as a rank's step enters with
    the state its scan built from every rank's S)."""
    H, K, V = t["v"].shape[2], t["q"].shape[-1], t["v"].shape[-1]
    dht = _randn(1, H, K, V, seed=6)

    def halves(q, k, v, g, g_gamma, do, gate_a, gate_bias):
        named = dict(t, q=q, k=k, v=v, g=g, g_gamma=g_gamma, do=do, gate_a=gate_a, gate_bias=gate_bias)
        S, D, *parts = gla.chunk_sums(*cases.op_args(named, dual))
        if dual:
            return (S, *gla.chunk_bwd_from_parts(parts, *_bwd_args(named, S, dht)))
        return (S, D, *gla.chunk_fwd_from_parts(parts, *_fwd_args(named, S)))

    return halves


@pytest.mark.compat  # the lowerings meet each torch's Inductor
@pytest.mark.usefixtures("inductor_triton")
@pytest.mark.parametrize("dual", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("gate", ["vector", "gamma"])
def test_compiled_halves_run_templates(gate, dual):
    """Compiled, both halves lower to the templates (no extern call of an op) and equal the eager ops."""
    from torch._inductor.utils import run_and_get_code

    t = _inputs(gate, T=130)
    args = [t[n] for n in ("q", "k", "v", "g", "g_gamma", "do", "gate_a", "gate_bias")]
    want = _compiled_halves(t, dual)(*args)
    got, (code,) = run_and_get_code(torch.compile(_compiled_halves(t, dual), fullgraph=True), *args)
    for op in ("chunk_sums", "chunk_fwd_from_parts", "chunk_bwd_from_parts"):
        assert f"torch.ops.gla_inductor.{op}.default(" not in code, f"{op} runs as an extern call"
    for i, (g, w) in enumerate(zip(got, want)):
        _close(g, w, f"output {i}")
