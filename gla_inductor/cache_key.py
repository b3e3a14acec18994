"""The key that keeps Inductor's caches honest about our code.

Inductor's FX-graph and AOTAutograd caches key compiled graphs on torch's sources and config, not on
third-party lowerings: after our templates or lowerings change, a warm cache would serve kernels
generated from the old ones. A custom graph pass's ``uuid()`` is part of the key, so we install a
pass that does nothing and whose uuid hashes every source and template file of the package.
"""

from __future__ import annotations

import functools
import pathlib

import torch


@functools.cache
def cache_key_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    root = pathlib.Path(__file__).parent
    files = tuple(sorted(str(p) for p in root.rglob("*") if p.suffix in (".py", ".jinja")))

    class GLACacheKey(CustomGraphPass):
        """Does nothing to the graph; its uuid is the hash of the package's files."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> bytes:
            return get_hash_for_files(self.files)

    key = GLACacheKey()
    key.files = files
    return key


def key_plain_compiles() -> None:
    """Plain ``torch.compile`` graphs that call our ops run our templates too (the lowerings are
    global): install the key as Inductor's post-grad post pass, unless the user set one. Our backend
    passes the key with each compile instead."""
    from torch._inductor import config

    if config.post_grad_custom_post_pass is None:
        config.post_grad_custom_post_pass = cache_key_pass()
