"""gla_inductor.explain's report: plain data for tools (JSON), file:line sources with the whole line
kept, printed rows within 100 columns, and layouts in role letters for every layout the
recognizers take."""

import inspect
import json

import pytest
import torch

import gla_inductor
from gla_inductor.explain import WIDTH, MatchInfo, NearMissInfo, Report
from spellings import DECODES, SPELLINGS

pytestmark = pytest.mark.compat

LONG_LINE = ("S = S * torch.exp(g_projection(hidden_states)[:, t, :, :, None]) + keys[:, t, :, :, None] * "
             "values[:, t, :, None, :]  # a long line, as in real models")


def _report() -> Report:
    return Report(
        matches=[
            MatchInfo("loop", "vector", "bthk", {"B": 8, "T": 16384, "H": 16, "K": 128, "V": 128},
                      {"reverse": True, "initial_state": True, "scale": 0.088}, [f"model.py:1234  {LONG_LINE}"]),
            MatchInfo("parallel", "scalar", "bhtk", {"B": 2, "T": 9, "H": 3, "K": 4, "V": 5},
                      {"final_state": True}, []),
        ],
        near_misses=[
            NearMissInfo("chunked", "the decay exponent is not of the form G_i - G_j of a cumulative sum over "
                         "time, and this reason goes on long enough to need a second line",
                         ["a_file_name_far_longer_than_any_column_should_be_" * 3 + "x.py:7  o = q @ S"]),
            NearMissInfo("loop", "delta-rule", []),
        ],
        graphs=2,
        rewrite_seconds=0.0123,
    )


def test_rows_fit_100_columns_and_show_file_line():
    text = str(_report())
    assert max(len(line) for line in text.splitlines()) <= WIDTH
    row = next(line for line in text.splitlines() if line.startswith("0  loop"))
    assert "model.py:1234  S = S * torch.exp" in row and row.endswith("...")
    assert "16384" in row and "reverse,h0" in row
    # the near miss's reason is wrapped below its row, not cut
    words = " ".join(text.split("left alone:")[1].split())
    assert "to need a second line" in words and "x.py:7" in words


def test_to_dict_is_plain_data_with_whole_lines():
    data = _report().to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["graphs"] == 2 and len(data["matches"]) == 2 and len(data["near_misses"]) == 2
    src = data["matches"][0]["source"][0]
    assert src == {"file": "model.py", "line": 1234, "code": LONG_LINE}
    assert data["matches"][0]["shapes"]["T"] == 16384
    assert data["matches"][0]["options"] == {"reverse": True, "initial_state": True, "scale": 0.088}
    assert data["near_misses"][0]["source"][0]["line"] == 7


def test_symbolic_sizes_become_plain():
    import sympy

    info = MatchInfo("loop", "none", "bthk", {"T": sympy.Symbol("s0"), "K": sympy.Integer(4)}, {}, [])
    assert info.to_dict()["shapes"] == {"T": "s0", "K": 4}
    json.dumps(info.to_dict())


def test_explain_points_at_the_users_line():
    """The source entries are the lines of the spelling's own source, whole."""
    sp = next(s for s in SPELLINGS if s.name == "loop_broadcast_setitem")
    torch._dynamo.reset()
    report = gla_inductor.explain(sp.fn, *sp.make(torch.float32))
    (match,) = report.to_dict()["matches"]
    lines, first = inspect.getsourcelines(sp.fn)
    assert match["source"], match
    for src in match["source"]:
        assert src["file"] == "spellings.py"
        assert lines[src["line"] - first].strip() == src["code"]
    assert any(src["code"].startswith("S = S * g[:, t].exp()") for src in match["source"])
    assert max(len(line) for line in str(report).splitlines()) <= WIDTH


# Layouts of q in role letters, one spelling of each layout the recognizers take (rewrite only, no
# Inductor compile). Mamba2's decode reads C by groups of heads: its group axis is part of the head
# axis, which the recognizers name by a sub-letter ("bAk") and the match reports as the role.
LAYOUTS = [
    ("loop_broadcast_setitem", "bthk"),
    ("loop_head_first_keepdim_cat", "bhtk"),
    ("loop_fused_qkv", "bthk"),
    ("loop_bmm_time_major", "tbk"),  # [T, B * H, K]: heads merged into the batch (H = 1)
    ("parallel_scalar_masked_fill", "bhtk"),
    ("parallel_scalar_einsum_where", "bthk"),
    ("chunked_ssd_minimal", "bthk"),
    ("chunk_loop_cat", "bhtk"),
    ("decode_broadcast_copy", "bhk"),
    ("decode_bmm_flat", "bk"),
    ("decode_mamba2", "bhk"),  # C [B, G, K]: the group part of the heads is reported as the heads
]
_BY_NAME = {s.name: s for s in SPELLINGS + DECODES}


@pytest.mark.parametrize("name, layout", LAYOUTS)
def test_layout_letters(name, layout):
    from gla_inductor.backend import rewrite

    sp = _BY_NAME[name]
    found = []

    def capture(gm, example_inputs):
        found.extend(m.layout for m in rewrite(gm, example_inputs).matches)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(sp.fn, backend=capture)(*sp.make(torch.float32))
    assert found == [layout]



# ---- every candidate discovery finds is in the report ------------------------------------------
# Programs that read like parallel GLA (q k^T under a decay, contracted with v over time) but are
# not candidates: each must appear as a near miss whose reason names the fact that failed.
_B, _H, _T, _K, _V = 2, 2, 7, 4, 5


def _decay(g):
    G = g.cumsum(-1)
    return (G[..., :, None] - G[..., None, :]).exp().tril()


def _diagonal_bonus(q, k, v, g, u):  # RWKV's bonus u on the current token, added to the scores
    A = q @ k.transpose(-1, -2) * _decay(g)
    return (A + torch.diag_embed((q * u * k).sum(-1))) @ v


def _bias_added(q, k, v, g, u):
    return (q @ k.transpose(-1, -2) * _decay(g) + u[..., :1]) @ v


def _four_inputs(q, k, v, g, u):
    return (q @ k.transpose(-1, -2) * _decay(g) * (u @ u.transpose(-1, -2))) @ v


def _prefix_sums_plus_state(q, k, v, g, u):  # GLA with an initial state, the sum not distributed
    h0 = u[..., :1, :, None] * v[..., :1, None, :]
    return (q[..., :, None] * ((k[..., :, None] * v[..., None, :]).cumsum(2) + h0)).sum(-2)


NOT_CANDIDATES = [
    (_diagonal_bonus, "the scores q k^T D are summed with 1 other term(s) (diag_embed) before the product "
                      "with v, expected the scores alone"),
    (_bias_added, "the scores q k^T D are summed with 1 other term(s) (u) before the product with v"),
    (_four_inputs, "the attention term multiplies four inputs (k, q, u, u), expected three (q, k, v)"),
    (_prefix_sums_plus_state, "the prefix sums of k^T v over time are summed with 1 other term(s) (u, v) before "
                              "the product with q, expected them alone"),
]


@pytest.mark.parametrize("fn, reason", NOT_CANDIDATES, ids=[f.__name__ for f, _ in NOT_CANDIDATES])
def test_every_candidate_is_reported(fn, reason, no_cost_rule):
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen) for s in
            [(_B, _H, _T, _K), (_B, _H, _T, _K), (_B, _H, _T, _V), (_B, _H, _T), (_B, _H, _T, _K)]]
    args[3] = torch.nn.functional.logsigmoid(args[3])
    torch._dynamo.reset()
    report = gla_inductor.explain(fn, *args)
    assert report.matches == []
    near = [n for n in report.near_misses if n.form == "parallel"]
    assert len(near) == 1 and near[0].reason.startswith(reason), [n.reason for n in near]
    assert near[0].source, "the near miss points at the user's line"


def _retention(mutation):
    """gamma ** (i - j) per head on the causal triangle (RetNet's decays), or a look-alike; q and k
    with half v's heads, repeated."""

    def fn(q, k, v):
        q, k = q.repeat_interleave(2, dim=1), k.repeat_interleave(2, dim=1)
        H, T = v.shape[1], v.shape[2]
        gamma = (-1 if mutation == "negative_base" else 1) * (1 - 2.0 ** (-3 - torch.arange(H, dtype=torch.float32)))
        i = torch.arange(T)
        D = gamma[:, None, None] ** (i[:, None] - i[None, :])
        if mutation != "non_causal":
            D = D.masked_fill(i[:, None] <= i[None, :] if mutation == "strict" else i[:, None] < i[None, :], 0)
        if mutation == "scaled":
            D = D / gamma[:, None, None]
        return (q @ k.transpose(-1, -2) * D) @ v

    return fn


RETENTION_LOOK_ALIKES = {
    "strict": "decay D[i, i] is 0 (at i=0), expected 1",
    "scaled": "decay D[i, i] is 1.143 (at i=0), expected 1: the decay is c * gamma ** (i - j) with c = 1.143",
    "non_causal": "decay D[i, j] for j > i is 1.143 (at i=0, j=1), expected 0",
    "negative_base": "decay D[1, 0] is -0.9844, expected a gamma > 0",
}


@pytest.mark.parametrize("mutation", list(RETENTION_LOOK_ALIKES))
def test_retention_look_alike_reasons(mutation):
    """Expected versus found, the first fact about the decay that failed (grouped heads alike)."""
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen) for s in [(2, 2, 5, 3), (2, 2, 5, 3), (2, 4, 5, 4)]]
    torch._dynamo.reset()
    report = gla_inductor.explain(_retention(mutation), *args)
    assert report.matches == []
    assert [n.reason[: len(RETENTION_LOOK_ALIKES[mutation])] for n in report.near_misses] == [
        RETENTION_LOOK_ALIKES[mutation]]


def test_retention_grouped_is_rewritten():
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen) for s in [(2, 2, 5, 3), (2, 2, 5, 3), (2, 4, 5, 4)]]
    torch._dynamo.reset()
    report = gla_inductor.explain(_retention(None), *args)
    assert [(m.form, m.gate, m.layout, m.shapes["H"]) for m in report.matches] == [("parallel", "constant", "bhtk", 4)]
