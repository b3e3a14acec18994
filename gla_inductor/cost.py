"""Whether a rewrite wins: a model of a candidate's time rewritten (our op) and left to Inductor.

A rewrite must never be slower than not rewriting. Where a GLA instance runs many steps, our op
wins by far (it reads every input once and keeps the state on chip); where it runs one or a few
steps without gradients (decoding), the work is a pass over the state, which Inductor fuses into
generated code nearly as well, and our op's host cost per call decides. The model compares, for
each candidate, the larger of host and device time on either side (the two overlap):

    ours     = max(HOST, (OUR_PASSES + OUR_PASSES_PER_STEP * T) * pass)
    inductor = max(HOST_GRAPH + HOST_GRAPH_PER_STEP * (T - 1), T * pass / INDUCTOR_EFFICIENCY)

with ``pass`` a read and a write of the [B, H, K, V] fp32 state at the device's copy bandwidth.
Where both sides are host-bound to the same time, the device times decide: under CUDA graphs
(``mode="reduce-overhead"``, serving engines' decode) only the device time remains, and there one
pass over the state beats one per step from the smallest batches on.
On CUDA our recurrent kernel makes one pass for all T steps (96% of copy bandwidth under CUDA
graphs), Inductor's code one pass per step (87-90%); on CPU our decode op is a PyTorch time loop
of three passes per step. The constants come from ``python -m benchmarks decode`` (the latest
result: benchmarks/results/README.md; called eagerly, the op lost to the compiled naive step at
B·H up to 4096 and won above) and lean to our side's pessimistic end: a candidate is rewritten
only where the model says it wins. Candidates with gradients, and every form but short steps, are
rewritten: there the op's chunked kernels and their backward win at every measured shape.

HOST is HOST_OP for an extern call of the eager op, HOST_LOWERED where the op is lowered into the
compiled graph's code (``lowerings/``): on CUDA our kernels are Inductor templates, launched from
the generated wrapper like Inductor's own kernels, unless ``config.decode_lowering`` is "extern".
On CPU the model keeps the extern op's cost: the decode op there lowers to Inductor's own code for
the step (the decomposition), which costs what not rewriting costs, so the candidate is left to
Inductor either way.

Under max-autotune (``config.cost_measure``) the backend times the candidates this model covers
instead of asking it (``recognize/measure.py``); the model decides those that cannot be timed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import config

__all__ = ["Candidate", "Estimate", "covers", "describe", "estimate", "lowered", "unprofitable_reason"]

# Steps up to which a candidate counts as "short": one pass over the state dominates its work.
SHORT_STEPS = 8


@dataclass(frozen=True)
class DeviceModel:
    bandwidth_gbs: float  # copy bandwidth, GB/s (bytes read + written)
    host_op_ms: float  # host cost of one call of our op (extern: through the dispatcher into Python)
    host_lowered_ms: float  # host cost of our op lowered into generated code (a template launch)
    host_graph_ms: float  # host cost of a compiled graph's generated kernel
    our_passes: float  # passes over the state our op makes per call, whatever T
    our_passes_per_step: float  # and per step
    inductor_efficiency: float  # Inductor's code's share of copy bandwidth on one pass per step
    host_graph_per_step_ms: float = 0.0  # Inductor's code launches a kernel per further step


MODELS = {
    "cpu": DeviceModel(bandwidth_gbs=10.0, host_op_ms=0.10, host_lowered_ms=0.10, host_graph_ms=0.01,
                       our_passes=0.0, our_passes_per_step=3.0, inductor_efficiency=1.0),
    "cuda": DeviceModel(bandwidth_gbs=4000.0, host_op_ms=0.20, host_lowered_ms=0.04, host_graph_ms=0.04,
                        our_passes=1 / 0.96, our_passes_per_step=0.0, inductor_efficiency=0.88,
                        host_graph_per_step_ms=0.01),
}


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
    lowered: bool = True  # False where the op would stay an extern call even when lowering is on


@dataclass(frozen=True)
class Estimate:
    ours_ms: float  # the larger of host and device time
    inductor_ms: float
    ours_device_ms: float = 0.0  # device time alone (what a CUDA graph replays)
    inductor_device_ms: float = 0.0

    def rewrite_wins(self) -> bool:
        """Faster, or as fast on the host and faster on the device."""
        if self.ours_ms != self.inductor_ms:
            return self.ours_ms < self.inductor_ms
        return self.ours_device_ms < self.inductor_device_ms


def estimate(c: Candidate) -> Optional[Estimate]:
    """The model's times for a short-step candidate on a known device, else None (not modelled)."""
    model = MODELS.get(c.device)
    if model is None or c.steps is None or c.batch_heads is None:
        return None
    pass_ms = c.batch_heads * c.K * c.V * 4 * 2 / (model.bandwidth_gbs * 1e6)
    steps = max(c.steps, 1)
    host = model.host_lowered_ms if lowered(c.device) and c.lowered else model.host_op_ms
    ours_device = (model.our_passes + model.our_passes_per_step * steps) * pass_ms
    inductor_device = steps * pass_ms / model.inductor_efficiency
    inductor_host = model.host_graph_ms + model.host_graph_per_step_ms * (steps - 1)
    return Estimate(max(host, ours_device), max(inductor_host, inductor_device), ours_device, inductor_device)


def lowered(device: str) -> bool:
    """Whether a rewritten short step runs as generated code on ``device`` (no extern call)."""
    return device == "cuda" and config.decode_lowering != "extern"


def covers(c: Candidate) -> bool:
    """Whether the model decides `c`: short steps without gradients on a modelled device (the
    candidates that max-autotune measures instead, ``recognize/measure.py``)."""
    return not c.needs_grad and c.steps is not None and c.steps <= SHORT_STEPS and estimate(c) is not None


def describe(c: Candidate) -> str:
    return f"T = {c.steps}, B·H = {c.batch_heads}, K = {c.K}, V = {c.V} on {c.device}"


def unprofitable_reason(c: Candidate) -> Optional[str]:
    """None where the rewrite wins (or is not modelled: long sequences, training), else why the
    candidate is left to Inductor, in the words ``explain`` prints."""
    if not covers(c):
        return None
    est = estimate(c)
    if est.rewrite_wins():
        return None
    return f"left to Inductor: {describe(c)}, estimated {est.ours_ms:.3f} ms rewritten vs {est.inductor_ms:.3f} ms"
