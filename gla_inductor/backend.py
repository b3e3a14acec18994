"""`gla_inductor.backend`: rewrite naive GLA in the Dynamo graph, then compile with Inductor.

The rewrite runs on the Dynamo graph, before AOTAutograd differentiates it, so the backward
of a rewritten graph is the GLA op's own backward (see NOTE in inductor.md §10). Anything
that goes wrong inside the rewrite is logged and the graph is compiled unchanged.
"""

from __future__ import annotations

import functools
import logging
import pathlib
from typing import Any

import torch
from torch._dynamo.utils import counters

from . import config
from .recognize import RewriteResult, rewrite_graph

log = logging.getLogger("gla_inductor")

# explain() listens here; every backend call reports its RewriteResult to each listener.
_listeners: list = []


def backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any):
    """A torch.compile backend: `torch.compile(model, backend=gla_inductor.backend)`.

    `mode=` and `options=` are honored as the inductor backend honors them."""
    result = rewrite(gm)
    for listen in _listeners:
        listen(gm, result)
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches(**kwargs))


def rewrite(gm: torch.fx.GraphModule) -> RewriteResult:
    """Rewrite `gm` in place; on any internal error log it and leave `gm` unchanged."""
    if not config.enabled:
        return RewriteResult()
    try:
        result = rewrite_graph(gm, forms=tuple(config.forms))
    except Exception:
        log.warning("gla_inductor: the GLA rewrite failed; compiling the graph unchanged", exc_info=True)
        counters["gla_inductor"]["failures"] += 1
        return RewriteResult()
    for m in result.matches:
        counters["gla_inductor"]["rewrites"] += 1
        counters["gla_inductor"][f"rewrites_{m.form}"] += 1
    counters["gla_inductor"]["near_misses"] += len(result.near_misses)
    return result


def config_patches(mode: str | None = None, options: dict | None = None, dynamic=None) -> dict:
    """Inductor config for compile_fx: the mode's and the user's options, plus our cache key."""
    patches: dict = {}
    if mode is not None and mode != "default":
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode, dynamic))
    patches.update(options or {})
    patches["post_grad_custom_post_pass"] = _cache_key_pass()
    return patches


@functools.cache
def _cache_key_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    root = pathlib.Path(__file__).parent
    files = tuple(sorted(str(p) for p in root.rglob("*") if p.suffix in (".py", ".jinja")))

    class GLACacheKey(CustomGraphPass):
        """Does nothing to the graph. Its uuid hashes every source and template file of the
        package, so Inductor's FX-graph and AOTAutograd caches never serve code compiled
        by another version of our lowerings or templates (which no cache key covers)."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> bytes:
            return get_hash_for_files(self.files)

    key = GLACacheKey()
    key.files = files
    return key
