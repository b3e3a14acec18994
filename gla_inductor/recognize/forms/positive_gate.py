"""A chunked computation whose gate is the decay itself (gamma, not log gamma): the op is given
log(gamma), computed in the graph, which is right only where gamma > 0.

The certificate draws such a gate positive (``certificate._agree``), so it proves the user's
code equal to GLA with log gate log(gamma) for every positive gamma. For gamma <= 0 the two
part: ``gamma ** n`` with gamma = -0.5 and integer n is a real number, exp(n log gamma) is NaN;
``gamma ** 0`` is 1 at gamma = 0, exp(0 * log 0) is NaN. So the rewrite either proves gamma
positive from how the graph computes it (an exp, a sigmoid, a softplus, through views and
casts), or refuses where module state holds a non-positive gamma at compile time, and checks
gamma > 0 on every call (``torch._assert_async``: H numbers for a per-head decay), raising
instead of returning NaN where a changed buffer or a new input is not positive.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..certify.spec import Spec
from ..core.analyzer import Analyzer
from ..core.consts import module_state
from ..core.emit import Emitter
from ..core.match import Reject
from ..core.op_names import VIEW_OPS, op_name

GUARD_MESSAGE = ("gla_inductor: the decay gamma of a rewritten chunked GLA is not positive; the rewrite reads "
                 "gamma ** n as exp(n log gamma), which holds for gamma > 0 only")

_POSITIVE_FNS = {torch.exp, torch.exp2, torch.sigmoid, F.softplus, torch._C._nn.softplus}
_POSITIVE_METHODS = {"exp", "exp2", "sigmoid"}


def needs_guard(an: Analyzer, spec: Spec) -> bool:
    """Whether the rewrite must check the gate positive at run time; Reject where module state
    holds a gate that is not positive now (the rewrite would only raise)."""
    if spec.g is None or spec.gate_is_log or proven_positive(spec.g.node):
        return False
    root = _through_views(spec.g.node)
    value = module_state(root) if root.op == "placeholder" else None
    if value is not None and not bool((value > 0).all()):
        raise Reject(f"the decay gamma ({root.name}) is not positive everywhere: gamma ** n is exp(n log gamma) "
                     "only for gamma > 0 (a negative gamma to an integer power alternates in sign)")
    return True


def proven_positive(n: fx.Node) -> bool:
    """n is positive by how it is computed: an exp, a sigmoid or a softplus, seen through views."""
    n = _through_views(n)
    if n.op == "call_method":
        return n.target in _POSITIVE_METHODS
    return n.op == "call_function" and n.target in _POSITIVE_FNS


def emit_guard(em: Emitter, gate: fx.Node) -> None:
    """gamma > 0 everywhere, checked in the graph on every call."""
    ok = em.call(torch.all, em.call(torch.gt, gate, 0))
    em.call(torch._assert_async, ok, GUARD_MESSAGE)


def _through_views(n: fx.Node) -> fx.Node:
    while op_name(n) in VIEW_OPS and n.all_input_nodes:
        n = n.all_input_nodes[0]
    return n
