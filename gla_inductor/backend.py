"""`gla_inductor.backend`: rewrite naive GLA in the Dynamo graph, then compile with Inductor.

The rewrite runs on the Dynamo graph, before AOTAutograd differentiates it, so the backward
of a rewritten graph is the GLA op's own backward (see NOTE in inductor.md §10). Anything
that goes wrong inside the rewrite is logged and the graph is compiled unchanged.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch._dynamo.utils import counters

from . import config, cost, ops  # noqa: F401  (ops: defines chunk_fwd)
from .cache_key import keyed
from .recognize import RewriteResult, measure, rewrite_graph
from .recognize.core.match import NearMiss
from .recognize.gate import chunk_fwd_targets, fuse_gates

log = logging.getLogger("gla_inductor")

# explain() listens here; every backend call reports its RewriteResult to each listener.
_listeners: list = []


def backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any):
    """A torch.compile backend: `torch.compile(model, backend=gla_inductor.backend)`.

    `mode=` and `options=` are honored as the inductor backend honors them; under max-autotune
    the cost rule measures its decisions (``config.cost_measure``)."""
    patches = config_patches(**kwargs)
    result = rewrite(gm, example_inputs, patches)
    for listen in _listeners:
        listen(gm, result)
    from torch._inductor.compile_fx import compile_fx

    from . import lowerings  # noqa: F401  (registers the GLA ops' lowerings on first use)

    return compile_fx(gm, example_inputs, config_patches=patches)


def rewrite(gm: torch.fx.GraphModule, example_inputs: list | None = None, patches: dict | None = None) -> RewriteResult:
    """Rewrite `gm` in place; on any internal error log it and leave `gm` unchanged. `patches`:
    the compile's Inductor options (``config_patches``), which say whether it runs max-autotune."""
    if not config.enabled:
        return RewriteResult()
    original = _copy(gm) if config.verify and example_inputs is not None else None
    decide = functools.partial(_unprofitable_reason, patches=patches or {})
    try:
        result = rewrite_graph(gm, forms=tuple(config.forms), unprofitable_reason=decide)
    except Exception:
        log.warning("gla_inductor: the GLA rewrite failed; compiling the graph unchanged", exc_info=True)
        counters["gla_inductor"]["failures"] += 1
        return RewriteResult()
    fused = _fuse_gates(gm)
    if original is not None and (result.matches or fused):
        why = _verify(original, gm, example_inputs)
        if why is not None:
            log.warning("gla_inductor: verify refused the rewrite: %s", why)
            counters["gla_inductor"]["verify_refused"] += 1
            gm.graph = original.graph
            gm.recompile()
            near = [NearMiss(m.form, f"verify: {why}", m.nodes) for m in result.matches]
            return RewriteResult([], result.near_misses + near, result.seconds)
    for m in result.matches:
        counters["gla_inductor"]["rewrites"] += 1
        counters["gla_inductor"][f"rewrites_{m.form}"] += 1
    counters["gla_inductor"]["near_misses"] += len(result.near_misses)
    return result


def _unprofitable_reason(m, an, patches: dict) -> str | None:
    """The cost rule on a recognized instance: why the rewrite would lose, or None to rewrite it.
    The model (``gla_inductor.cost``) decides, or where this compile measures, the times of both
    choices (``recognize/measure.py``); a candidate that cannot be timed goes back to the model."""
    if not config.cost_rule:
        return None
    candidate = _candidate(m)
    how = _measuring(patches)
    if candidate is None or how is None or not cost.covers(candidate):
        return None if candidate is None else cost.unprofitable_reason(candidate)
    try:
        t = measure.measure(an, m, patches)
    except Exception as e:  # noqa: BLE001 - a choice not measured is the model's
        log.warning("gla_inductor: could not time a %s-form candidate (%s); the cost model decides", m.form, e)
        counters["gla_inductor"]["measure_failures"] += 1
        return cost.unprofitable_reason(candidate)
    text = f"{how}, {cost.describe(candidate)}: {t.ours_ms:.4f} ms rewritten vs {t.inductor_ms:.4f} ms"
    if t.rewrite_wins():
        m.note = f"rewritten: {text}"
        return None
    return f"left to Inductor: {text}"


def _measuring(patches: dict) -> str | None:
    """How this compile's cost rule is measured (the words explain prints), or None where the
    model decides."""
    from torch._inductor import config as inductor_config

    if config.cost_measure not in ("max-autotune", "always", "never"):
        raise ValueError(f"gla_inductor.config.cost_measure is 'max-autotune', 'always' or 'never', not "
                         f"{config.cost_measure!r}")
    if config.cost_measure == "max-autotune" and patches.get("max_autotune", inductor_config.max_autotune):
        return "measured under max-autotune"
    return "measured" if config.cost_measure == "always" else None


def _candidate(m) -> cost.Candidate | None:
    """What the cost rule reads of a match: sizes (symbolic ones by their hints), device, grad."""
    values = [v for v in (n.meta.get("example_value") for n in m.nodes) if isinstance(v, torch.Tensor)]
    if not values:
        return None
    sizes = {k: _size_hint(v) for k, v in m.shapes.items()}
    B, T, H, K, V = (sizes.get(c) for c in "BTHKV")
    if K is None or V is None:
        return None
    # the decode lowering folds a constant scale into its template; a computed one stays an extern call
    lowered = isinstance(m.options.get("scale", 1.0), (int, float))
    return cost.Candidate(form=m.form, steps=T, batch_heads=None if B is None or H is None else B * H, K=K, V=V,
                          device=values[0].device.type, needs_grad=any(v.requires_grad for v in values),
                          lowered=lowered)


def _size_hint(size) -> int | None:
    """A size as an int: symbolic sizes (``dynamic=True``) by the value Dynamo traced with, the
    model's decision for every size the graph serves (it differs only near the break-even batch)."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return hint if isinstance(hint, int) else None
    return None


def _fuse_gates(gm: torch.fx.GraphModule) -> int:
    """Gate fusion (recognize/gate.py) on the rewritten graph; on any internal error the graph
    goes back to how the GLA rewrite left it."""
    if not config.fuse_gates or not any(n.target in chunk_fwd_targets() for n in gm.graph.nodes):
        return 0
    backup = _copy(gm)
    try:
        fused = fuse_gates(gm)
    except Exception:
        log.warning("gla_inductor: gate fusion failed; compiling the unfused GLA ops", exc_info=True)
        counters["gla_inductor"]["failures"] += 1
        gm.graph = backup.graph
        gm.recompile()
        return 0
    counters["gla_inductor"]["fused_gates"] += fused
    return fused


def _copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    graph = torch.fx.Graph(owning_module=gm, tracer_cls=gm.graph._tracer_cls)
    val_map: dict = {}
    out, old_output = graph.graph_copy(gm.graph, val_map, return_output_node=True)
    graph.output(out).meta = dict(old_output.meta)
    for old, new in val_map.items():
        if hasattr(old, "_dynamo_source"):  # Dynamo keeps input sources on the node object
            new._dynamo_source = old._dynamo_source
    return torch.fx.GraphModule(gm, graph)


def _verify(original: torch.fx.GraphModule, rewritten: torch.fx.GraphModule, inputs: list) -> str | None:
    """None when both graphs agree on the example inputs, else what differs."""
    from torch._subclasses.fake_tensor import is_fake

    if any(isinstance(x, torch.Tensor) and is_fake(x) for x in inputs):
        return None  # no values to run on
    with torch.no_grad():
        want = original(*inputs)
        got = rewritten(*inputs)
    for i, (w, g) in enumerate(zip(want, got)):
        if not isinstance(w, torch.Tensor):
            continue
        scale = w.abs().max().clamp_min(1e-30) if w.numel() else 1.0
        err = ((g.double() - w.double()).abs().max() / scale).item() if w.numel() else 0.0
        if w.shape != g.shape or not err <= config.verify_rtol:
            return f"output {i} differs (relative error {err:.1e})"
    return None


def config_patches(mode: str | None = None, options: dict | None = None, dynamic=None) -> dict:
    """Inductor config for compile_fx: the mode's and the user's options, plus our cache key."""
    patches: dict = {}
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode, dynamic))
    patches.update(options or {})
    from torch._inductor import config as inductor_config

    user_pass = patches.get("post_grad_custom_post_pass", inductor_config.post_grad_custom_post_pass)
    patches["post_grad_custom_post_pass"] = keyed(user_pass)
    return patches
