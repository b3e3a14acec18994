"""Batch size 1, the usual inference batch: every real model of test_transformers_gla.py prefills
one sequence with one rewrite per GLA layer and logits equal to eager's. With B = 1 the batch axis
has size 1 and the shape-based readings of the chunked forms must not take the heads for the
batch (a per-head decay would then look as if it depended on the batch)."""

import pytest
import torch
from torch._dynamo.utils import counters

from helpers import rel_err
from test_transformers_gla import MODELS, T_PREFILL, TOL, VOCAB, call, like_trained, rewrites
from gla_inductor.backend import rewrite

pytestmark = [pytest.mark.usefixtures("one_thread", "seeded_compiler")]


def rewrite_then_eager(gm, example_inputs):
    rewrite(gm, example_inputs)
    return gm.forward


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_of_one_sequence(name, no_cost_rule):
    model, layers = MODELS[name]()
    model = like_trained(model.eval())
    ids = torch.randint(0, VOCAB, (1, T_PREFILL), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend=rewrite_then_eager, dynamic=False)
    counters.clear()
    with torch.no_grad():
        e, c = call(model, ids), call(compiled, ids)
    assert rel_err(c.logits, e.logits) <= TOL
    assert rewrites() == layers, dict(counters["gla_inductor"])
