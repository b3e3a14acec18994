"""The GLA call contract: the ops' schemas are the contract's argument names, a call survives the
trip through the op's arguments, and the rules read shapes of tensors and graph nodes alike."""

import warnings

import pytest
import torch
import torch.fx as fx

import gla_inductor
from gla_inductor.contract import CHUNK_BWD_ARGS, CHUNK_FWD_ARGS, RECURRENT_ARGS, GLACall, gate_kind, group_size
from gla_inductor.gates import GateFn


@pytest.mark.parametrize("op, names", [("chunk_fwd", CHUNK_FWD_ARGS), ("chunk_bwd", CHUNK_BWD_ARGS),
                                       ("fused_recurrent", RECURRENT_ARGS)])
def test_op_schemas_are_the_contract(op, names):
    schema = getattr(torch.ops.gla_inductor, op).default._schema
    assert tuple(a.name for a in schema.arguments) == names


def _call(**changes):
    q, v = torch.randn(2, 5, 2, 4), torch.randn(2, 5, 4, 3)
    return GLACall(q, q.clone(), v, **changes)


def test_plain_call_round_trips_through_nine_arguments():
    call = _call(g=torch.randn(2, 5, 4), scale=0.5, output_final_state=True)
    args = call.op_args()
    assert len(args) == 9 and args[6:] == (0.5, True, False)
    back = GLACall.from_op_args(args)
    assert all(getattr(back, f) is getattr(call, f) for f in ("q", "k", "v", "g", "g_gamma", "initial_state"))
    assert (back.scale, back.output_final_state, back.reverse, back.gate) == (0.5, True, False, GateFn())
    assert len(call.op_args(full=True)) == CHUNK_FWD_ARGS.index("cu_seqlens")  # every gate argument
    assert len(call.replace(cu_seqlens=torch.tensor([0, 5])).op_args()) == len(CHUNK_FWD_ARGS)


def test_fused_gate_call_spells_every_argument():
    a, bias = torch.randn(4), torch.randn(4)
    call = _call(g=torch.randn(2, 5, 4), gate=GateFn("softplus", 1.0, None, 2.0), gate_a=a, gate_bias=bias)
    args = call.op_args()
    assert len(args) == 15
    back = GLACall.from_op_args(args)
    assert back.gate == call.gate and back.gate_a is a and back.gate_bias is bias and back.fused_gate


def test_keyword_arguments_bind_by_name():
    call = _call()
    back = GLACall.from_op_args(call.op_args()[:3], {"reverse": True, "scale": 0.25, "g_gamma": None})
    assert back.reverse and back.scale == 0.25 and back.gate_kind == "none"


def test_backward_and_recurrent_arguments():
    call = _call(g=torch.randn(2, 5, 4, 4), scale=0.3, reverse=True)
    do, state = torch.randn(2, 5, 4, 3), torch.zeros(2, 4, 4, 3)
    bwd = call.bwd_op_args(do, None)
    assert dict(zip(CHUNK_BWD_ARGS, bwd))["do"] is do and len(bwd) == 10
    rec = GLACall.from_op_args(call.recurrent_op_args(state), names=RECURRENT_ARGS)
    assert rec.initial_state is state and rec.output_final_state and rec.reverse and rec.gate_kind == "vector"


def test_rules_read_graph_nodes_like_tensors():
    graph = fx.Graph()
    q, v, g = graph.placeholder("q"), graph.placeholder("v"), graph.placeholder("g")
    q.meta["example_value"], v.meta["example_value"] = torch.empty(1, 3, 2, 8), torch.empty(1, 3, 6, 5)
    g.meta["val"] = torch.empty(1, 3, 6)
    assert group_size(q, v) == 3 and gate_kind(g, None) == "scalar"
    assert GLACall(q, q, v, g).gate_kind == "scalar"


def test_with_log_gate_applies_the_fused_function():
    x = torch.randn(2, 5, 4)
    call = _call(g=x, gate=GateFn("logsigmoid", 0.5))
    plain = call.with_log_gate()
    assert not plain.fused_gate and torch.allclose(plain.g, torch.nn.functional.logsigmoid(x) * 0.5)
    assert _call().with_log_gate().gate == GateFn()


def test_head_first_looking_inputs_warn_once_per_call_site():
    q = torch.randn(1, 2, 8, 4)  # T = 2 steps, H = 8 heads: a [B, H, T, K] tensor, most likely

    def call_site():
        gla_inductor.chunk_gla(q, q, q)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            call_site()
    layout = [w for w in seen if issubclass(w.category, gla_inductor.LayoutWarning)]
    assert len(layout) == 1 and "transpose" in str(layout[0].message) and layout[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gla_inductor.chunk_gla(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2))  # T >= H: silent
        warnings.simplefilter("ignore", gla_inductor.LayoutWarning)
        call_site()  # silenced as the message says
