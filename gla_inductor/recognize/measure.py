"""Whether a short-step rewrite wins, measured instead of modelled.

The cost model (``gla_inductor/cost.py``) decides decoding and short steps without gradients by
constants fit on a few machines; near its break-even batch, on another machine or another dtype,
it can be wrong either way. Under ``mode="max-autotune"`` the user has asked for compile time to
be spent choosing, so the backend times both choices instead, as Inductor times its templates:

    left to Inductor   the user's nodes of the candidate
    rewritten          the match's replacement of them (our op, lowered as in the real compile)

each a module of the same leaves, read off the match applied in a scratch transaction by the
extraction the trial certificate uses (``certify/trial.sides``), compiled by Inductor with the
compile's own options (so that what is timed is our lowering or template, not the eager op's
host path) and run on random inputs of the leaves' shapes, dtypes and device. Times include the
host's: a call's time is the larger of its host and device work, which is what the model's host
terms stand for; where the compile replays CUDA graphs, only the device time remains.

A decision is kept per key (both modules' structure and constants, the leaves' shapes, dtypes and
device, the options that change the code), so the layers of a model and recompiles pay once. Any
failure raises: the backend falls back to the model's decision (``backend._unprofitable_reason``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._dynamo.utils import counters

from .. import config
from .certify import trial
from .core.analyzer import Analyzer
from .core.consts import example_value
from .core.match import Match

DECISIONS: dict = {}  # key -> Measurement, or why the candidate could not be measured

# How much faster the rewrite must be to be chosen: closer times are within a busy host's noise
# (on CPU both sides are often the same generated code), and a tie goes to the user's own code.
MARGIN = 0.03


@dataclass(frozen=True)
class Measurement:
    ours_ms: float  # the rewritten module's time per call
    inductor_ms: float  # the user's module's time per call

    def rewrite_wins(self) -> bool:
        return self.ours_ms < (1 - MARGIN) * self.inductor_ms


class Unmeasurable(Exception):
    """The candidate's two sides could not be built, compiled or timed; the message says why."""


def measure(an: Analyzer, match: Match, patches: dict) -> Measurement:
    """Both sides of `match` timed (or the kept decision for its key); Unmeasurable or another
    exception where they cannot be."""
    sides = trial.sides(an, match)
    if isinstance(sides, str):
        raise Unmeasurable(sides)
    original, rewritten, leaves = sides
    values = [example_value(x) for x in leaves]
    key = _key(original, rewritten, values, patches)
    if key not in DECISIONS:
        if len(DECISIONS) > 256:
            DECISIONS.clear()
        try:
            DECISIONS[key] = _measure(original, rewritten, values, patches)
        except Exception as e:  # noqa: BLE001 - kept: a recompile need not fail again
            DECISIONS[key] = f"{type(e).__name__}: {e}"
    if isinstance(DECISIONS[key], str):
        raise Unmeasurable(DECISIONS[key])
    return DECISIONS[key]


def _key(original: fx.GraphModule, rewritten: fx.GraphModule, values: list, patches: dict) -> tuple:
    leaves = tuple((tuple(_hint(s) for s in v.shape), v.dtype, v.device.type) if isinstance(v, torch.Tensor)
                   else _hint(v) for v in values)
    options = tuple(sorted((k, v) for k, v in patches.items() if isinstance(v, (bool, int, float, str))))
    ours = (config.decode_lowering, config.triton_kernels, config.cpu_kernel)
    return (*trial.pair_key(original, rewritten), leaves, options, ours)


def _measure(original: fx.GraphModule, rewritten: fx.GraphModule, values: list, patches: dict) -> Measurement:
    from torch._inductor import config as inductor_config

    counters["gla_inductor"]["measured"] += 1
    inputs = [_random(v) for v in values]
    device = next(v.device for v in values if isinstance(v, torch.Tensor))
    with torch.no_grad():
        ours, theirs = (_compile(m, inputs, patches) for m in (rewritten, original))
        graphs = device.type == "cuda" and bool(patches.get("triton.cudagraphs", inductor_config.triton.cudagraphs))
        return Measurement(*_time_both(ours, theirs, inputs, device, graphs))


def _hint(size):
    """A size as an int: a symbolic one by the value Dynamo traced with."""
    return size.node.hint if isinstance(size, torch.SymInt) else size


def _random(val):
    """An input like the leaf's example value. Floating values are drawn in (0, 1): positive, so
    that a decay the rewrite checks positive at run time passes (the times do not depend on the
    values otherwise); integers are zeros, a valid index of any axis."""
    if isinstance(val, (int, torch.SymInt)):
        return _hint(val)
    if not isinstance(val, torch.Tensor):
        raise Unmeasurable(f"an input of the candidate is a {type(val).__name__}, neither a tensor nor a size")
    shape = tuple(_hint(s) for s in val.shape)
    if val.is_floating_point():
        return torch.rand(shape, dtype=val.dtype, device=val.device)
    return torch.zeros(shape, dtype=val.dtype, device=val.device)


def _compile(gm: fx.GraphModule, inputs: list, patches: dict):
    """gm compiled by Inductor with the compile's options, outside the Dynamo compile that asked
    (its tracing context holds the user's graph's fake tensors and guards). Without CUDA graphs:
    a replay would need the trees' step marks; the device time is what a replay costs."""
    from torch._guards import tracing
    from torch._inductor.compile_fx import compile_fx

    from .. import lowerings  # noqa: F401  (the GLA ops' lowerings, as the real compile has them)

    for n in gm.graph.nodes:  # (the user's fake values belong to the outer compile's fake mode)
        n.meta = {k: v for k, v in n.meta.items() if k == "stack_trace"}
    with tracing(None):
        return compile_fx(gm, inputs, config_patches={**patches, "triton.cudagraphs": False})


def _time_both(ours, theirs, inputs: list, device: torch.device, graphs: bool) -> tuple:
    """(ours, theirs) in ms per call, each the best of a few rounds, alternating sides (a shared
    host's load falls on both)."""
    best = [float("inf"), float("inf")]
    for _ in range(3):
        for i, fn in enumerate((ours, theirs)):
            best[i] = min(best[i], _time(fn, inputs, device, graphs))
    return best[0], best[1]


def _time(fn, inputs: list, device: torch.device, graphs: bool) -> float:
    from torch._inductor.runtime.benchmarking import benchmarker

    def call():
        fn(*inputs)

    for _ in range(3):  # (first calls allocate and load)
        call()
    if device.type != "cuda":
        return benchmarker.benchmark_cpu(call, warmup=2, rep=20)
    device_ms = benchmarker.benchmark_gpu(call)
    if graphs:
        return device_ms
    torch.cuda.synchronize(device)
    start, calls = time.perf_counter(), 100
    for _ in range(calls):
        call()
    torch.cuda.synchronize(device)
    return max(device_ms, (time.perf_counter() - start) * 1000 / calls)
