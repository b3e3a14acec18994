"""The public functions traced whole by ``torch.compile(fullgraph=True)``: ``chunk_gla`` with every
gate kind, fused gates, initial and final states, packed sequences and prefix states, and
``fused_recurrent_gla`` with a plain state and a state pool. What they build in the traced frame (the
``GateFn`` of the gate arguments, the ``GLACall`` of the op's arguments, with its default gate) must
trace on every torch the package supports (torch 2.11's Dynamo could not wrap a dataclass instance
as a default argument value: every compiled call broke). Each compiled result, outputs and
gradients, must equal the eager call's. ``context_parallel_gla`` compiled:
tests/distributed/test_dist_context_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

import gla_inductor
from helpers import gla_inputs

pytestmark = [pytest.mark.usefixtures("one_thread", "fresh_compiler"), pytest.mark.compat]

TOL = dict(rtol=1e-6, atol=1e-6)  # the same op on the same inputs: only the graph around it differs
B, T, H, K, V = 2, 9, 2, 4, 3

# gate kind -> (which of helpers.gla_inputs' gates, chunk_gla's gate keywords); the fused gates' g is
# the function's input x, and "softplus" brings its parameters a and bias
GATES = {
    "vector": ("vector", {}),
    "scalar": ("scalar", {}),
    "constant": ("constant", {}),
    "none": ("none", {}),
    "logsigmoid": ("vector", dict(gate_fn="logsigmoid", gate_scale=1 / 16, gate_lo=-3.0)),
    "softplus": ("scalar", dict(gate_fn="softplus", gate_lo=0.05, gate_hi=4.0)),
}


def _inputs(kind: str, **shape) -> dict:
    """chunk_gla's keyword inputs for a gate kind, the fused gates' parameters included."""
    gate, options = GATES[kind]
    inputs = dict(gla_inputs(gate, **{"B": B, "T": T, "H": H, "K": K, "V": V, **shape}), **options)
    if options.get("gate_fn") == "softplus":
        gen = torch.Generator().manual_seed(3)
        inputs["g"] = 3 * torch.randn(inputs["g"].shape, generator=gen)  # x, not a log gate
        inputs["gate_a"] = -0.2 - torch.rand(inputs["v"].shape[2], generator=gen)
        inputs["gate_bias"] = torch.randn(inputs["g"].shape[2:], generator=gen)
    elif options.get("gate_fn") == "logsigmoid":
        inputs["g"] = 3 * torch.randn(inputs["g"].shape, generator=torch.Generator().manual_seed(3))
    return inputs


def _run(fn, inputs: dict, backward: bool = True, **kw):
    """fn's outputs and, with backward, the gradients of its tensor inputs under fixed random
    upstream gradients (fresh leaves: inputs are left alone)."""
    leaves = {n: x.detach().clone().requires_grad_(backward) if isinstance(x, torch.Tensor) else x
              for n, x in inputs.items()}
    out = [x for x in fn(**leaves, **kw) if x is not None]
    if not backward:
        return out, {}
    gen = torch.Generator().manual_seed(1)
    loss = sum((x * torch.randn(x.shape, generator=gen, dtype=x.dtype)).sum() for x in out)
    tensors = {n: x for n, x in leaves.items() if isinstance(x, torch.Tensor) and x.requires_grad}
    grads = torch.autograd.grad(loss, list(tensors.values()), allow_unused=True, materialize_grads=True)
    return [x.detach() for x in out], dict(zip(tensors, grads))


def _assert_compiled_equals_eager(fn, inputs: dict, backend="aot_eager", backward: bool = True, **compile_kw):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend, **compile_kw)
    got, got_grads = _run(compiled, inputs, backward)
    want, want_grads = _run(fn, inputs, backward)
    assert len(got) == len(want) > 0
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"output {i}: {m}")
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert grad.abs().max() > 0, f"d{name} is zero: the check would not see a wrong gradient"
        torch.testing.assert_close(got_grads[name], grad, **TOL, msg=lambda m: f"d{name}: {m}")


def _chunk(**inputs):
    return gla_inductor.chunk_gla(**inputs, output_final_state=True)


@pytest.mark.parametrize("kind", GATES)
def test_chunk_gla(kind):
    """Every gate kind and both fused gates, from an initial state, forward and backward."""
    _assert_compiled_equals_eager(_chunk, _inputs(kind))


@pytest.mark.parametrize("kind", ["vector", "softplus"])
def test_chunk_gla_grouped_reverse_no_initial_state(kind):
    inputs = _inputs(kind, G=1, with_h0=False)

    def fn(**x):
        return gla_inductor.chunk_gla(**x, reverse=True, scale=0.3)

    _assert_compiled_equals_eager(fn, inputs)


def test_chunk_gla_dynamic_shapes():
    _assert_compiled_equals_eager(_chunk, _inputs("logsigmoid"), dynamic=True)


@pytest.mark.parametrize("kind", ["scalar", "logsigmoid"])
def test_chunk_gla_packed_sequences(kind):
    """cu_seqlens: three packed sequences, one state each."""
    inputs = _inputs(kind, B=1)
    inputs["initial_state"] = torch.randn(3, H, K, V, generator=torch.Generator().manual_seed(5))
    offsets = torch.tensor([0, 4, 4, T])

    def fn(**x):
        return gla_inductor.chunk_gla(**x, cu_seqlens=offsets, output_final_state=True)

    _assert_compiled_equals_eager(fn, inputs)


def test_chunk_gla_prefix_states():
    """output_prefix_states (inference: forward only)."""

    def fn(**x):
        return gla_inductor.chunk_gla(**x, output_final_state=True, output_prefix_states=True, state_interval=16)

    _assert_compiled_equals_eager(fn, _inputs("softplus", T=40), backward=False)


def test_chunk_gla_through_the_backends():
    """The fused gate through plain Inductor and through gla_inductor.backend (which leaves a
    chunk_gla call alone), forward and backward."""
    inputs = _inputs("logsigmoid")
    _assert_compiled_equals_eager(_chunk, inputs, backend="inductor")
    _assert_compiled_equals_eager(_chunk, inputs, backend=gla_inductor.backend)


@pytest.mark.parametrize("kind", ["vector", "scalar", "constant", "none"])
def test_fused_recurrent_gla(kind):
    inputs = _inputs(kind, T=3)

    def fn(**x):
        return gla_inductor.fused_recurrent_gla(**x, output_final_state=True)

    _assert_compiled_equals_eager(fn, inputs, backward=False)


@pytest.mark.parametrize("inplace", [False, True], ids=["gathered", "inplace"])
def test_fused_recurrent_gla_state_pool(inplace):
    """ssm_state_indices: slots of a pool of 5, one entry padded (-1). In place, the compiled call must
    leave the pool as the eager call does."""
    inputs = _inputs("vector", B=3, T=2)
    pool = torch.randn(5, H, K, V, generator=torch.Generator().manual_seed(4))
    indices = torch.tensor([3, -1, 0])
    pools = {}

    def fn(**x):
        return gla_inductor.fused_recurrent_gla(**x, output_final_state=True, ssm_state_indices=indices,
                                                inplace_final_state=inplace)

    for name in ("eager", "compiled"):
        x = dict(inputs, initial_state=pool.clone())
        run = fn if name == "eager" else torch.compile(fn, fullgraph=True, backend="aot_eager")
        pools[name] = (run(**x), x["initial_state"])
    (o, ht), state = pools["compiled"]
    (o_ref, ht_ref), state_ref = pools["eager"]
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(ht, ht_ref, **TOL)
    torch.testing.assert_close(state, state_ref, **TOL)
    assert torch.equal(state[[1, 2, 4]], pool[[1, 2, 4]])  # untouched slots
    assert inplace != torch.equal(state, pool)
