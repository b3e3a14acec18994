"""Real models from transformers, compiled with the backend: Mamba2 gains one GLA op per layer
(prefill, prefill continued from a cached state, one-token decode) and matches eager; look-alikes
(Gated DeltaNet, Kimi delta attention, mLSTM, normalized retention) are left alone, exactly.

Tiny random configurations, no weights, no network. transformers' fast paths must be absent
(mamba_ssm, causal_conv1d, flash-linear-attention, kernels): the plain PyTorch code is what the
backend is for. By default the graphs run the rewritten Dynamo graph eagerly (Inductor's CPU
compile of a whole model takes minutes on a small machine and is not what these tests check);
`--slow` runs the full backend, Inductor included.
"""

import copy
import importlib.util

import pytest
import torch
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.backend import rewrite

from helpers import FP32_TOL, rel_err, rewrite_then_eager

transformers = pytest.importorskip("transformers")

FAST_PATHS = ("mamba_ssm", "causal_conv1d", "fla", "kernels")

pytestmark = [pytest.mark.usefixtures("one_thread", "seeded_compiler"), pytest.mark.compat]


def installed(name: str) -> bool:
    """A module or regular package `name` can be imported. Not a namespace package: the test
    folders (tests/kernels/ among them) are ones on sys.path, and transformers ignores those too."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def test_fast_paths_are_absent():
    present = [m for m in FAST_PATHS if installed(m)]
    assert not present, f"transformers would run {present} instead of its PyTorch code"


def backend(slow: bool):
    return gla_inductor.backend if slow else rewrite_then_eager


def rewrites() -> int:
    n = counters["gla_inductor"]["rewrites"]
    counters.clear()
    return n


# ---- Mamba2 ----------------------------------------------------------------------------------
LAYERS = 2


def mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    cfg = Mamba2Config(
        vocab_size=32, hidden_size=32, num_hidden_layers=LAYERS, num_heads=4, head_dim=16, expand=2,
        state_size=8, n_groups=2, chunk_size=8, conv_kernel=4,
    )
    return Mamba2ForCausalLM(cfg).eval()


def ssm_states(cache) -> list:
    return [cache.layers[i].recurrent_states[0] for i in range(LAYERS)]


def check_step(model, compiled, ids, cache_e, cache_c):
    """One call, eager and compiled, on caches that hold the same state."""
    e = model(ids, cache_params=cache_e, use_cache=True)
    c = compiled(ids, cache_params=cache_c, use_cache=True)
    assert rel_err(c.logits, e.logits) <= FP32_TOL
    for sc, se in zip(ssm_states(c.cache_params), ssm_states(e.cache_params)):
        assert rel_err(sc, se) <= FP32_TOL
    return e.cache_params, c.cache_params


def run_mamba2(slow: bool) -> dict:
    """Prefill (13 tokens: a partial last chunk), continue (6 tokens), decode (1 token).

    dynamic=False: the chunked form is certified at static sizes, and the continuation's new
    length would otherwise make Dynamo trace it with a symbolic length (left alone then)."""
    model = mamba2()
    compiled = torch.compile(model, backend=backend(slow), dynamic=False)
    found = {}
    with torch.no_grad():
        cache_e, cache_c = check_step(model, compiled, torch.randint(0, 32, (2, 13)), None, None)
        found["prefill"] = rewrites()
        cache_e, cache_c = check_step(model, compiled, torch.randint(0, 32, (2, 6)), cache_e, cache_c)
        found["continue"] = rewrites()
        check_step(model, compiled, torch.randint(0, 32, (2, 1)), cache_e, cache_c)
        found["decode"] = rewrites()
    return found


def test_mamba2_one_rewrite_per_layer():
    assert run_mamba2(slow=False) == {"prefill": LAYERS, "continue": LAYERS, "decode": LAYERS}


@pytest.mark.slow
def test_mamba2_full_backend():
    assert run_mamba2(slow=True) == {"prefill": LAYERS, "continue": LAYERS, "decode": LAYERS}


def test_mamba2_trains():
    """Training (no cache): one chunk_fwd per layer, and every parameter's gradient matches
    eager's (the op's own backward replaces the scan's)."""
    model = mamba2().train()
    ids = torch.randint(0, 32, (2, 13))
    compiled = torch.compile(model, backend=rewrite_then_eager, dynamic=False)
    loss = compiled(ids, use_cache=False).logits.square().mean()
    assert rewrites() == LAYERS
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(model(ids, use_cache=False).logits.square().mean(), list(model.parameters()))
    for (name, _), g, w in zip(model.named_parameters(), got, want):
        assert rel_err(g, w) <= FP32_TOL, name


def test_mamba2_padded_gate_is_fused():
    """Mamba2's scan pads the gate a * dt along time to a chunk multiple: the fused op gets x padded
    with -inf (softplus(-inf) = 0, the padded gate's value). Training gradients match eager."""
    model = mamba2().train()
    ids = torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(0))
    loss = torch.compile(model, backend=rewrite_then_eager, dynamic=False)(ids, use_cache=False).logits.square().mean()
    assert counters["gla_inductor"]["fused_gates"] == LAYERS
    got = torch.autograd.grad(loss, list(model.parameters()))
    want = torch.autograd.grad(model(ids, use_cache=False).logits.square().mean(), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        assert rel_err(a, b) <= FP32_TOL, name


def test_mamba2_decode_runs_in_place():
    """Generation's decode (no grad): one fused_recurrent per layer on the cache itself."""
    model = mamba2()
    seen = []

    def capture(gm, example_inputs):
        rewrite(gm, example_inputs)
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    with torch.no_grad():
        cache = model(torch.randint(0, 32, (2, 5)), use_cache=True).cache_params
        torch.compile(model, backend=capture)(torch.randint(0, 32, (2, 1)), cache_params=cache, use_cache=True)
    assert seen[-1].count("gla_inductor.fused_recurrent.default") == LAYERS


# ---- look-alikes: zero rewrites, outputs exactly eager's --------------------------------------
def assert_left_alone(fn, *args, **kwargs):
    want = fn(*copy.deepcopy(args), **kwargs)
    got = torch.compile(fn, backend=rewrite_then_eager)(*args, **kwargs)
    assert rewrites() == 0
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        if isinstance(w, torch.Tensor):
            assert torch.equal(g, w)


def test_qwen3_next_gated_deltanet_is_left_alone():
    """Gated DeltaNet (chunked prefill with the delta rule, recurrent decode): not GLA."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=16, shared_expert_intermediate_size=16,
    )
    model = Qwen3NextForCausalLM(cfg).eval()
    compiled = torch.compile(model, backend=rewrite_then_eager)
    with torch.no_grad():
        ids = torch.randint(0, 32, (2, 11))
        e = model(ids, use_cache=True)
        c = compiled(ids, use_cache=True)
        assert rewrites() == 0 and torch.equal(c.logits, e.logits)
        step = torch.randint(0, 32, (2, 1))
        e = model(step, past_key_values=e.past_key_values, use_cache=True)
        c = compiled(step, past_key_values=c.past_key_values, use_cache=True)
        assert rewrites() == 0 and torch.equal(c.logits, e.logits)


def delta_inputs(T=11, H=2, K=8, V=8, vector_gate=False):
    q, k = torch.randn(2, T, H, K), torch.nn.functional.normalize(torch.randn(2, T, H, K), dim=-1)
    v, beta = torch.randn(2, T, H, V), torch.rand(2, T, H)
    g = torch.nn.functional.logsigmoid(torch.randn(2, T, H, K) if vector_gate else torch.randn(2, T, H))
    return q, k, v, g, beta, torch.randn(2, H, K, V)


@pytest.mark.parametrize("T", [1, 11])
def test_gated_deltanet_functions_are_left_alone(T):
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    q, k, v, g, beta, h0 = delta_inputs(T)
    assert_left_alone(m.torch_recurrent_gated_delta_rule, q, k, v, g, beta, initial_state=h0, output_final_state=True)
    if T > 1:
        assert_left_alone(m.torch_chunk_gated_delta_rule, q, k, v, g, beta, chunk_size=4,
                          initial_state=h0, output_final_state=True)


@pytest.mark.parametrize("T", [1, 11])
def test_kimi_delta_attention_is_left_alone(T):
    from transformers.models.kimi_linear import modeling_kimi_linear as m

    q, k, v, g, beta, h0 = delta_inputs(T, vector_gate=True)
    assert_left_alone(m.recurrent_kimi_delta_attention, q, k, v, g, beta, h0, True)
    if T > 1:
        assert_left_alone(m.chunk_kimi_delta_attention, q, k, v, g, beta, initial_state=h0,
                          output_final_state=True, chunk_size=4)


def test_mlstm_is_left_alone():
    """mLSTM: a normalizer and a max-stabilizer state; the chunkwise and sequence forms."""
    from transformers.models.xlstm import modeling_xlstm as m

    if not hasattr(m, "mlstm_chunkwise_native_autograd"):
        pytest.skip("the xlstm package is installed: transformers uses its kernels")
    B, H, T, K, V = 2, 2, 16, 8, 8
    q, k, v = torch.randn(B, H, T, K), torch.randn(B, H, T, K), torch.randn(B, H, T, V)
    i, f = torch.randn(B, H, T), torch.randn(B, H, T) + 3
    assert_left_alone(m.mlstm_chunkwise_native_autograd, q, k, v, i, f, chunk_size=4, return_last_states=True)
    assert_left_alone(m.mlstm_recurrent_sequence_native, q, k, v, i, f, return_last_states=True)


def normalized_retention(q, k, v, gamma):
    """RetNet's parallel retention with torchscale's normalizations: decay rows scaled by
    1/sqrt(row sum), scores divided by their clamped absolute row sum. GLA only up to a
    per-row scale."""
    T = q.shape[2]
    n = torch.arange(T)
    mask = torch.exp((n[:, None] - n[None, :]).masked_fill(n[:, None] < n[None, :], 10**4) * gamma[:, None, None])
    mask = torch.nan_to_num(mask) * (n[:, None] >= n[None, :])
    mask = mask / mask.sum(-1, keepdim=True).sqrt()
    qk = (q @ k.transpose(-1, -2)) * mask
    qk = qk / qk.detach().abs().sum(-1, keepdim=True).clamp(min=1)
    return qk @ v


def test_normalized_retention_is_left_alone():
    q, k, v = torch.randn(2, 3, 9, 4), torch.randn(2, 3, 9, 4), torch.randn(2, 3, 9, 5)
    gamma = torch.log(1 - 2.0 ** (-5 - torch.arange(3.0)))
    assert_left_alone(normalized_retention, q, k, v, gamma)
