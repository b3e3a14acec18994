"""Whether a rewrite wins: a model of a candidate's time rewritten (our op) and left to Inductor.

A rewrite must never be slower than not rewriting. Where a GLA instance runs many steps, our op
wins by far (it reads every input once and keeps the state on chip); where it runs one or a few
steps without gradients (decoding), the work is one pass over the state, which Inductor fuses into
generated code as well as we can, and our op's host cost per call decides. So the model compares,
for each candidate:

    ours     = HOST_OP  + passes_ours     * state_bytes / bandwidth
    inductor = HOST_GRAPH + passes_inductor * state_bytes / bandwidth

with one pass a read and a write of the [B, H, K, V] state in fp32: our op makes ``OUR_PASSES``
(its kernel's pass, and the functionalized in-place update's copy where the state is a cache the
graph writes), Inductor's code one per step. The constants come from the decode benchmark
(``python -m benchmarks decode``; benchmarks/results/README.md lists the latest result) and are
deliberately on our side's pessimistic end: a candidate is rewritten only where the model says it
wins. Candidates with gradients, and every form but short steps, are rewritten: there the op's
chunked kernels and their backward win at every measured shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

__all__ = ["Candidate", "Estimate", "estimate", "unprofitable_reason"]

# Steps up to which a candidate counts as "short": one pass over the state dominates its work.
SHORT_STEPS = 8


@dataclass(frozen=True)
class DeviceModel:
    bandwidth_gbs: float  # a state pass's rate, GB/s (read + write counted)
    host_op_ms: float  # host cost of one call of our op inside a compiled graph
    host_graph_ms: float  # host cost of a compiled graph's generated kernel call
    our_passes: float  # passes over the state our op's call makes (kernel, functionalization copy)


# CPU: two cores of the CI machine; CUDA: an H100/H200 (decode benchmark, no CUDA graph).
MODELS = {
    "cpu": DeviceModel(bandwidth_gbs=10.0, host_op_ms=0.10, host_graph_ms=0.01, our_passes=3.0),
    "cuda": DeviceModel(bandwidth_gbs=2500.0, host_op_ms=0.15, host_graph_ms=0.035, our_passes=2.0),
}
# Under CUDA graphs the host costs vanish for both; a cache mutated in place keeps the graph out
# of capture for both as well (torch skips cudagraphs on mutated inputs), so "reduce-overhead"
# changes nothing for such steps.


@dataclass(frozen=True)
class Candidate:
    """What the cost model needs of one recognized GLA instance."""

    form: str  # "loop", "decode", "parallel", "chunked", "chunk_loop"
    steps: Optional[int]  # T, None where symbolic
    batch_heads: Optional[int]  # B * H, None where symbolic
    K: int
    V: int
    device: str  # "cpu", "cuda", ...
    needs_grad: bool


@dataclass(frozen=True)
class Estimate:
    ours_ms: float
    inductor_ms: float


def estimate(c: Candidate) -> Optional[Estimate]:
    """The model's times for a short-step candidate on a known device, else None (not modelled)."""
    model = MODELS.get(c.device)
    if model is None or c.steps is None or c.batch_heads is None:
        return None
    pass_ms = c.batch_heads * c.K * c.V * 4 * 2 / (model.bandwidth_gbs * 1e6)
    ours = model.host_op_ms + model.our_passes * pass_ms
    inductor = model.host_graph_ms + max(c.steps, 1) * pass_ms
    return Estimate(ours, inductor)


def unprofitable_reason(c: Candidate) -> Optional[str]:
    """None where the rewrite wins (or is not modelled: long sequences, training), else why the
    candidate is left to Inductor, in the words ``explain`` prints."""
    if c.needs_grad or c.steps is None or c.steps > SHORT_STEPS:
        return None
    est = estimate(c)
    if est is None or est.ours_ms < est.inductor_ms:
        return None
    return (f"left to Inductor: T = {c.steps}, B·H = {c.batch_heads}, K = {c.K}, V = {c.V} on {c.device}, "
            f"estimated {est.ours_ms:.3f} ms rewritten vs {est.inductor_ms:.3f} ms")
