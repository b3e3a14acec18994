"""The key that keeps Inductor's caches honest about our code.

Inductor's FX-graph and AOTAutograd caches key compiled graphs on torch's sources and config, not on
third-party lowerings: after our templates or lowerings change, a warm cache would serve kernels
generated from the old ones. A custom graph pass's ``uuid()`` is part of the key, so we install a
pass that does nothing and whose uuid hashes every source and template file of the package, and the
switches of ``gla_inductor.config`` that change what the lowerings generate.
"""

from __future__ import annotations

import functools
import pathlib

import torch


@functools.cache
def cache_key_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    root = pathlib.Path(__file__).parent
    files = tuple(sorted(str(p) for p in root.rglob("*") if p.suffix in (".py", ".jinja", ".cpp")))

    class GLACacheKey(CustomGraphPass):
        """Does nothing to the graph; its uuid is the hash of the package's files and of the
        lowering switches (read at each compile: a switch flipped between compiles of one graph
        must not be served the other's code)."""

        def __call__(self, graph: torch.fx.Graph) -> None:
            return None

        def uuid(self) -> bytes:
            return get_hash_for_files(self.files) + repr(_lowering_switches()).encode()

    key = GLACacheKey()
    key.files = files
    return key


def _lowering_switches() -> tuple:
    from . import config

    return (config.decode_lowering, config.triton_kernels, tuple(config.triton_gates))


def keyed(user_pass=None):
    """The pass to hand Inductor: our key, or the user's own post-grad pass run as before with a
    uuid that covers both (a user pass without one keeps disabling the cache, as it would alone)."""
    ours = cache_key_pass()
    if user_pass is None or user_pass is ours or getattr(user_pass, "keyed_by_gla", False):
        return user_pass or ours
    return _with_user_pass_class()(user_pass, ours)


@functools.cache
def _with_user_pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class WithUserPass(CustomGraphPass):
        keyed_by_gla = True

        def __init__(self, user_pass, ours):
            self.user_pass, self.ours = user_pass, ours

        def __call__(self, graph: torch.fx.Graph) -> None:
            return self.user_pass(graph)

        def uuid(self):
            theirs = self.user_pass.uuid() if hasattr(self.user_pass, "uuid") else None
            return None if theirs is None else repr((theirs, self.ours.uuid())).encode()

    return WithUserPass


def key_plain_compiles() -> None:
    """Plain ``torch.compile`` graphs that call our ops run our templates too (the lowerings are
    global): install the key as Inductor's post-grad post pass, unless the user set one. Our backend
    passes the key with each compile instead."""
    from torch._inductor import config

    if config.post_grad_custom_post_pass is None:
        config.post_grad_custom_post_pass = cache_key_pass()
