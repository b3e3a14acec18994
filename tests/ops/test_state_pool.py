"""Decoding into a serving engine's state pool: ``fused_recurrent_gla(..., initial_state=pool,
ssm_state_indices=idx, inplace_final_state=True)`` and the ``gla_inductor::fused_recurrent`` op's
``state_indices`` argument.

Every implementation (the PyTorch time loop, the chunked route for longer steps, the Triton kernel,
under the interpreter on CPU) is checked against per-slot runs of the float64 time loop of
``gla_inductor.reference``: outputs, the updated slots, the untouched slots bit for bit, padded
entries (zeros, no slot touched), fp32 and bf16 pools, [K, V] and V-first [V, K] layouts.
"""

import re
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import gla_inductor
from gla_inductor.contract import RECURRENT_ARGS, GLACall
from gla_inductor.kernels import recurrent as recurrent_kernels
from gla_inductor.ops import dispatch
from gla_inductor.reference import naive_recurrent_gla

ON_GPU = torch.cuda.is_available()
triton = pytest.importorskip("triton")
pytest.importorskip("jinja2")
KERNELS_RUN_HERE = ON_GPU or type(triton.language.cumsum).__name__ == "InterpretedFunction"
needs_kernels = pytest.mark.skipif(not KERNELS_RUN_HERE, reason="triton was imported without TRITON_INTERPRET=1")

# in the compatibility subset: the pool kernel once failed only under the newest triton's interpreter
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.compat]

fp32, bf16 = torch.float32, torch.bfloat16
GATES = ("vector", "scalar", "constant", "none")
# relative (Frobenius) error bounds against float64, by the dtype of the result compared
TOL = {fp32: 1e-5, bf16: 1e-2}
PAD = -1


@dataclass(frozen=True)
class Case:
    gate: str = "vector"
    T: int = 1
    pool_dtype: torch.dtype = fp32
    v_first: bool = False  # the pool stored [P, H, V, K]
    dtype: torch.dtype = fp32  # q, k, v, g
    reverse: bool = False
    B: int = 5
    P: int = 9
    H: int = 2
    K: int = 16
    V: int = 40  # two V tiles of 32 in the kernel, the second partial
    index_dtype: torch.dtype = torch.int64


def _inputs(case: Case, device="cpu", seed=0):
    """q, k, v, g, g_gamma, the pool as stored, idx: entries 1 and 3 padded (-1 and P, out of range),
    the others distinct slots in no particular order."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V, P = case.B, case.T, case.H, case.K, case.V, case.P

    def rand(*shape, dtype=case.dtype):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q, k, v = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, H, V)
    g = g_gamma = None
    if case.gate == "vector":
        g = F.logsigmoid(rand(B, T, H, K, dtype=fp32)).to(case.dtype)
    elif case.gate == "scalar":
        g = F.logsigmoid(rand(B, T, H, dtype=fp32)).to(case.dtype)
    elif case.gate == "constant":
        g_gamma = F.logsigmoid(rand(H, dtype=fp32))
    pool = rand(P, H, V, K, dtype=case.pool_dtype) if case.v_first else rand(P, H, K, V, dtype=case.pool_dtype)
    slots = [7, PAD, 2, P, 0, 5, 3, 8][:B]
    idx = torch.tensor(slots, dtype=case.index_dtype, device=device)
    return q, k, v, g, g_gamma, pool, idx


def _kv(pool: torch.Tensor, case: Case) -> torch.Tensor:
    """The [P, H, K, V] view of the pool as stored."""
    return pool.transpose(-1, -2) if case.v_first else pool


def _expected(case: Case, q, k, v, g, g_gamma, pool, idx, scale):
    """(o, the pool after the call as stored) from per-slot runs of the float64 loop."""
    f64 = lambda x: None if x is None else x.double()  # noqa: E731
    o = torch.zeros(*v.shape, dtype=torch.float64)
    after = pool.clone()
    for b, slot in enumerate(idx.tolist()):
        if not 0 <= slot < case.P:
            continue
        h0 = _kv(pool, case)[slot:slot + 1]
        o_b, ht_b = naive_recurrent_gla(f64(q[b:b + 1]), f64(k[b:b + 1]), f64(v[b:b + 1]),
                                        None if g is None else f64(g[b:b + 1]), g_gamma=f64(g_gamma), scale=scale,
                                        initial_state=f64(h0), output_final_state=True, reverse=case.reverse)
        o[b] = o_b[0]
        _kv(after, case)[slot] = ht_b[0].to(after.dtype)
    return o, after


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)).item()


def _check(case: Case, o, pool_after, pool_before, expected_o, expected_pool, idx):
    valid = [0 <= s < case.P for s in idx.tolist()]
    touched = {s for s, ok in zip(idx.tolist(), valid) if ok}
    for b, ok in enumerate(valid):
        if not ok:
            assert torch.equal(o[b], torch.zeros_like(o[b])), f"padded entry {b} has a nonzero output"
    assert _rel_err(o, expected_o) <= TOL[o.dtype], f"o: relative error {_rel_err(o, expected_o):.2e}"
    for slot in range(case.P):
        if slot in touched:
            err = _rel_err(pool_after[slot], expected_pool[slot])
            # the stored state is rounded to the pool's dtype once, from fp32
            assert err <= TOL[case.pool_dtype], f"slot {slot}: relative error {err:.2e}"
        else:
            assert torch.equal(pool_after[slot], pool_before[slot]), f"untouched slot {slot} changed"


def _run(impl: str, case: Case, q, k, v, g, g_gamma, pool, idx, scale):
    """o of one implementation, updating the pool (as stored) in place."""
    call = GLACall(q, k, v, g, g_gamma, _kv(pool, case), scale, reverse=case.reverse, state_indices=idx)
    if impl == "torch":  # the op's CPU route: the PyTorch time loop
        return dispatch.fused_recurrent(call, _kv(pool, case))
    if impl == "chunks":  # steps past the time loop's length: the chunked implementation, gathered and scattered
        return dispatch._via_chunks(call, _kv(pool, case))
    if impl == "kernel":  # the GPU route: the Triton kernel (interpreted on CPU tensors)
        assert recurrent_kernels.unsupported_reason(call, _kv(pool, case)) is None
        return dispatch.fused_recurrent_gpu(call, _kv(pool, case))
    o, returned = gla_inductor.fused_recurrent_gla(
        q, k, v, g, g_gamma=g_gamma, scale=scale, initial_state=pool, output_final_state=True,
        reverse=case.reverse, ssm_state_indices=idx, inplace_final_state=True, state_v_first=case.v_first)
    assert returned is pool
    return o


CASES = [Case(gate, T, pool_dtype, v_first) for gate in GATES for T in (1, 4) for pool_dtype in (fp32, bf16)
         for v_first in (False, True)]
CASES += [
    Case("vector", T=3, dtype=bf16, pool_dtype=bf16, v_first=True, reverse=True),
    Case("scalar", T=2, dtype=bf16, index_dtype=torch.int32),
    Case("constant", T=1, B=8, P=9, reverse=True, index_dtype=torch.int32),
]


def _case_id(c: Case) -> str:
    parts = [c.gate, f"T{c.T}", f"pool_{str(c.pool_dtype)[6:]}", "vk" if c.v_first else "kv"]
    if c.dtype != fp32:
        parts.append(f"in_{str(c.dtype)[6:]}")
    if c.reverse:
        parts.append("reverse")
    if c.index_dtype != torch.int64:
        parts.append("idx32")
    return "-".join(parts)


@pytest.mark.parametrize("impl", ["torch", "api"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pool_decode_cpu(case, impl):
    q, k, v, g, g_gamma, pool, idx = _inputs(case)
    before = pool.clone()
    expected_o, expected_pool = _expected(case, q, k, v, g, g_gamma, pool, idx, 0.3)
    o = _run(impl, case, q, k, v, g, g_gamma, pool, idx, 0.3)
    assert o.dtype == case.dtype
    _check(case, o, _kv(pool, case), _kv(before, case), expected_o, _kv(expected_pool, case), idx)


@needs_kernels
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_pool_decode_kernel(case, monkeypatch):
    calls = []
    forward = recurrent_kernels.forward
    monkeypatch.setattr(recurrent_kernels, "forward", lambda *a, **kw: calls.append(a) or forward(*a, **kw))
    q, k, v, g, g_gamma, pool, idx = _inputs(case)
    before = pool.clone()
    expected_o, expected_pool = _expected(case, q, k, v, g, g_gamma, pool, idx, 0.3)
    if ON_GPU:  # the kernels run on CUDA tensors there (on CPU ones under the interpreter)
        q, k, v, g, g_gamma, pool, idx = (None if x is None else x.cuda() for x in (q, k, v, g, g_gamma, pool, idx))
    o = _run("kernel", case, q, k, v, g, g_gamma, pool, idx, 0.3)
    # the kernel ran once, reading and writing the pool itself (a V-first pool through a view of it)
    assert len(calls) == 1 and calls[0][1].data_ptr() == pool.data_ptr()
    _check(case, o.cpu(), _kv(pool, case).cpu(), _kv(before, case), expected_o, _kv(expected_pool, case), idx.cpu())


@pytest.mark.parametrize("case", [Case("vector", T=5, pool_dtype=bf16, v_first=True), Case("scalar", T=9)],
                         ids=_case_id)
def test_pool_decode_via_chunks(case):
    """Longer steps run the chunked implementation on the gathered slots, then scatter them back."""
    q, k, v, g, g_gamma, pool, idx = _inputs(case)
    before = pool.clone()
    expected_o, expected_pool = _expected(case, q, k, v, g, g_gamma, pool, idx, 0.3)
    o = _run("chunks", case, q, k, v, g, g_gamma, pool, idx, 0.3)
    _check(case, o, _kv(pool, case), _kv(before, case), expected_o, _kv(expected_pool, case), idx)


def test_padded_entries_ignore_nonfinite_inputs():
    """A padded entry's inputs may hold anything (a serving engine pads with stale rows): its output
    is still exactly zero and no slot changes, even where that entry's stand-in slot 0 is another
    entry's target."""
    case = Case("vector", T=2)
    q, k, v, g, g_gamma, pool, idx = _inputs(case)
    q[1], v[3] = float("nan"), float("inf")
    before = pool.clone()
    expected_o, expected_pool = _expected(case, q, k, v, g, g_gamma, pool, idx, 0.3)
    o = _run("torch", case, q, k, v, g, g_gamma, pool, idx, 0.3)
    _check(case, o, pool, before, expected_o, expected_pool, idx)


def test_all_entries_padded_touch_nothing():
    case = Case("scalar", T=1)
    q, k, v, g, g_gamma, pool, _ = _inputs(case)
    idx = torch.full((case.B,), PAD)
    before = pool.clone()
    o = _run("api", case, q, k, v, g, g_gamma, pool, idx, 0.3)
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(pool, before)


# ----------------------------------------------------------------------------------------------
# fused_recurrent_gla: the other combinations of the arguments
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
def test_indices_without_inplace_leave_the_pool_alone(v_first):
    """Read through the indices, final states returned fresh (fp32, the pool's layout, zeros for
    padded entries), the pool unmodified."""
    case = Case("vector", T=2, pool_dtype=bf16, v_first=v_first)
    q, k, v, g, g_gamma, pool, idx = _inputs(case)
    before = pool.clone()
    expected_o, expected_pool = _expected(case, q, k, v, g, g_gamma, pool.double(), idx, 0.3)
    o, ht = gla_inductor.fused_recurrent_gla(q, k, v, g, scale=0.3, initial_state=pool, output_final_state=True,
                                             ssm_state_indices=idx, state_v_first=v_first)
    assert torch.equal(pool, before), "the pool was modified"
    assert ht.dtype == fp32 and ht.shape == ((case.B, case.H, case.V, case.K) if v_first else
                                             (case.B, case.H, case.K, case.V))
    assert _rel_err(o, expected_o) <= TOL[fp32]
    for b, slot in enumerate(idx.tolist()):
        if 0 <= slot < case.P:
            assert _rel_err(ht[b], expected_pool[slot]) <= TOL[fp32], f"final state {b}"
        else:
            assert torch.equal(ht[b], torch.zeros_like(ht[b])) and torch.equal(o[b], torch.zeros_like(o[b]))


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
def test_batch_state_with_and_without_inplace(inplace, v_first):
    """Without indices: initial_state [B, H, K, V] (or [B, H, V, K]) is modified only when
    inplace_final_state, which then returns it as the final state; otherwise a fresh fp32 state."""
    case = Case("scalar", T=3, pool_dtype=bf16, v_first=v_first, P=5, B=5)
    q, k, v, g, g_gamma, state, _ = _inputs(case)
    before = state.clone()
    expected_o, expected_state = _expected(case, q, k, v, g, g_gamma, state, torch.arange(case.B), 0.3)
    o, ht = gla_inductor.fused_recurrent_gla(q, k, v, g, scale=0.3, initial_state=state, output_final_state=True,
                                             inplace_final_state=inplace, state_v_first=v_first)
    assert _rel_err(o, expected_o) <= TOL[fp32]
    if inplace:
        assert ht is state and _rel_err(state, expected_state) <= TOL[bf16]
    else:
        assert torch.equal(state, before) and ht.dtype == fp32 and ht.shape == state.shape
        exact = _expected(case, q, k, v, g, g_gamma, state.double(), torch.arange(case.B), 0.3)[1]
        assert _rel_err(ht, exact) <= TOL[fp32]
    _, none = gla_inductor.fused_recurrent_gla(q, k, v, g, initial_state=state, inplace_final_state=inplace,
                                               state_v_first=v_first)
    assert none is None


def test_errors_name_the_argument():
    case = Case("vector")
    q, k, v, g, _, pool, idx = _inputs(case)
    api = gla_inductor.fused_recurrent_gla
    with pytest.raises(ValueError, match=r"fused_recurrent_gla: ssm_state_indices needs initial_state"):
        api(q, k, v, g, ssm_state_indices=idx)
    with pytest.raises(ValueError, match=r"fused_recurrent_gla: inplace_final_state=True needs initial_state"):
        api(q, k, v, g, inplace_final_state=True)
    with pytest.raises(TypeError, match=r"ssm_state_indices must be an int32 or int64 tensor, got torch.float32"):
        api(q, k, v, g, initial_state=pool, ssm_state_indices=idx.float())
    with pytest.raises(ValueError, match=r"ssm_state_indices has shape \(4,\).*\[B\] = \[5\]"):
        api(q, k, v, g, initial_state=pool, ssm_state_indices=idx[:4])
    with pytest.raises(ValueError, match=r"initial_state has shape \(9, 2, 40, 16\).*\[P, H, K, V\] = \[P, 2, 16, 40"):
        api(q, k, v, g, initial_state=pool.mT.contiguous(), ssm_state_indices=idx)
    with pytest.raises(ValueError, match=r"initial_state has shape \(9, 2, 16, 40\).*\[P, H, V, K\] = \[P, 2, 40, 16"):
        api(q, k, v, g, initial_state=pool, ssm_state_indices=idx, state_v_first=True)
    with pytest.raises(ValueError, match=r"initial_state has shape \(5, 2, 16, 40\).*\[B, H, V, K\] = \[5, 2, 40, 16"):
        api(q, k, v, g, initial_state=pool[:5], state_v_first=True)
    with pytest.raises(ValueError, match=r"state_indices has shape \(2, 5\)"):
        torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, pool, 0.3, False, idx.expand(2, 5))


# ----------------------------------------------------------------------------------------------
# the op: arguments, registrations, torch.compile
# ----------------------------------------------------------------------------------------------


def test_op_arguments_without_indices_stay_the_eight():
    """Graph snapshots print fused_recurrent calls: without indices they keep their 8 arguments."""
    q, k, v, g, _, pool, idx = _inputs(Case("vector"))
    plain = GLACall(q, k, v, g, scale=0.3).recurrent_op_args(pool[:5])
    assert len(plain) == 8 and plain[5] is not None
    pooled = GLACall(q, k, v, g, scale=0.3, state_indices=idx).recurrent_op_args(pool)
    assert len(pooled) == 9 and pooled[-1] is idx and RECURRENT_ARGS[-1] == "state_indices"
    back = GLACall.from_op_args(pooled, names=RECURRENT_ARGS)
    assert back.state_indices is idx and back.initial_state is pool
    assert GLACall.from_op_args(plain, names=RECURRENT_ARGS).state_indices is None
    schema = torch.ops.gla_inductor.fused_recurrent.default._schema
    assert [a.name for a in schema.arguments] == list(RECURRENT_ARGS)


@pytest.mark.parametrize("pool_dtype", [fp32, bf16])
def test_op_registrations_with_indices(pool_dtype):
    case = Case("vector", T=2, pool_dtype=pool_dtype)
    q, k, v, g, _, pool, idx = _inputs(case)
    torch.library.opcheck(torch.ops.gla_inductor.fused_recurrent.default,
                          (q, k, v, g, None, pool, 0.3, False, idx))
    torch.library.opcheck(torch.ops.gla_inductor.fused_recurrent.default,
                          (q, k, v, None, None, pool.mT.contiguous().mT, 0.3, True, idx.int()))


@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
def test_compiled_pool_decode_updates_the_pool_in_place(v_first):
    """fullgraph: no break; reinplaced: the op's state argument is the graph input (a view of it for
    a V-first pool), not a copy of the whole pool written back; untouched slots stay bit-equal."""
    from torch._inductor.utils import run_and_get_code

    case = Case("vector", T=1, v_first=v_first)
    q, k, v, g, g_gamma, pool, idx = _inputs(case)
    before = pool.clone()
    expected_o, expected_pool = _expected(case, q, k, v, g, g_gamma, pool, idx, 0.3)

    def step(q, k, v, g, pool, idx):
        o, _ = gla_inductor.fused_recurrent_gla(q, k, v, g, scale=0.3, initial_state=pool, ssm_state_indices=idx,
                                                inplace_final_state=True, state_v_first=v_first)
        return o * 2

    torch._dynamo.reset()
    address = pool.data_ptr()
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    out, (code, *_) = run_and_get_code(compiled, q, k, v, g, pool, idx)
    assert pool.data_ptr() == address
    _check(case, out / 2, _kv(pool, case), _kv(before, case), expected_o, _kv(expected_pool, case), idx)
    assert re.search(r"fused_recurrent\.default\(.*, (reinterpret_tensor\()?arg\d+_1\b.*, arg\d+_1\)", code), code
    assert "copy_" not in code and "clone" not in code, code
    # a second step continues from the updated slots, as a decoding loop does
    step_two = _expected(case, q, k, v, g, g_gamma, pool, idx, 0.3)
    out = compiled(q, k, v, g, pool, idx)
    _check(case, out / 2, _kv(pool, case), _kv(expected_pool, case), step_two[0], _kv(step_two[1], case), idx)
    torch._dynamo.reset()


@pytest.mark.parametrize("pooled", [True, False], ids=["gather", "plain"])
def test_compiled_without_inplace(pooled):
    """The read-only paths (the slots gathered, or the plain [B, H, K, V] state, run on a copy)
    compile without a graph break too."""
    case = Case("scalar", T=2, pool_dtype=bf16, P=9 if pooled else 5)
    q, k, v, g, _, pool, idx = _inputs(case)
    before = pool.clone()

    def step(q, k, v, g, pool, idx):
        return gla_inductor.fused_recurrent_gla(q, k, v, g, scale=0.3, initial_state=pool, output_final_state=True,
                                                ssm_state_indices=idx if pooled else None)

    torch._dynamo.reset()
    eager = step(q, k, v, g, pool, idx)
    compiled = torch.compile(step, backend="inductor", fullgraph=True)(q, k, v, g, pool, idx)
    torch._dynamo.reset()
    assert torch.equal(pool, before)
    for a, b in zip(compiled, eager):
        assert _rel_err(a, b) <= 1e-6


# ----------------------------------------------------------------------------------------------
# CUDA graphs (run on a GPU)
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("v_first", [False, True], ids=["kv", "vk"])
def test_pool_decode_captures_in_a_cuda_graph(v_first):
    """Captured once over a fixed batch; replays read the indices and inputs copied into the static
    tensors, as a serving engine's decode graph does (padded entries included)."""
    case = Case("vector", T=1, v_first=v_first, B=4, P=16, H=4, K=64, V=64)
    q, k, v, g, g_gamma, pool, idx = _inputs(case, "cuda")

    def step():
        return gla_inductor.fused_recurrent_gla(q, k, v, g, scale=0.3, initial_state=pool, ssm_state_indices=idx,
                                                inplace_final_state=True, state_v_first=v_first)[0]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    saved = pool.clone()
    with torch.cuda.stream(stream):
        step()  # warm-up: compile the kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    pool.copy_(saved)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = step()
    pool.copy_(saved)  # capture ran nothing, but be exact about the starting point
    for seed, slots in ((1, [3, PAD, 15, 0]), (2, [PAD, 9, 3, 12])):
        fresh = _inputs(case, "cuda", seed=seed)
        for static, new in zip((q, k, v, g), fresh[:4]):
            static.copy_(new)
        idx.copy_(torch.tensor(slots, device="cuda"))
        before = pool.clone()
        expected_o, expected_pool = _expected(case, *(x.cpu() if x is not None else None
                                                      for x in (q, k, v, g, g_gamma, before, idx)), 0.3)
        graph.replay()
        torch.cuda.synchronize()
        _check(case, o.cpu(), _kv(pool, case).cpu(), _kv(before, case).cpu(), expected_o,
               _kv(expected_pool, case), idx.cpu())
