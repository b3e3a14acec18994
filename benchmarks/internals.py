"""Every internal of gla_inductor the tools use, in one place (the benchmarks proper use the public
API: ``gla_inductor.chunk_gla``, ``fused_recurrent_gla``, ``backend`` and the ``torch.ops.gla_inductor``
ops). When the package's internals move or change their signatures, this is the file to adapt.

Launchers are wrapped in functions of named arguments, so that a change of their argument lists
touches only these wrappers.
"""

from __future__ import annotations

import contextlib
import dataclasses

from gla_inductor.backend import _listeners
from gla_inductor.contract import GLACall
from gla_inductor.gates import GateFn
from gla_inductor.impl import step_loop
from gla_inductor.impl.chunked import BT as CPU_CHUNK, _block_sums, _chunk_bwd_torch, _chunk_fwd_torch
from gla_inductor.kernels import chunk as kchunk, configs as kconfigs, recurrent as krecurrent, standalone
from gla_inductor.recognize import rewrite_graph

__all__ = [
    "CPU_CHUNK", "ChunkConfig", "GateFn", "RecurrentConfig", "TileConfig", "backend_listener", "block_sums",
    "chunk_bwd_kernel", "chunk_fwd_kernel", "cpu_backward_gates", "cpu_step_backward", "cpu_step_forward",
    "chunked_backward_torch", "chunked_forward_torch", "default_chunk_config", "default_recurrent_config",
    "dqkg_kernel", "f32_precision", "launch_via_triton", "local_kernel", "local_slices", "patched_templates",
    "recurrent_kernel", "rewrite_graph", "sm90_kernel_options", "standalone",
]

TileConfig = kconfigs.TileConfig
ChunkConfig = kconfigs.ChunkConfig
RecurrentConfig = krecurrent.RecurrentConfig
default_recurrent_config = krecurrent.default_recurrent_config
block_sums = _block_sums


# ---------------------------------------------------------------------------------------------
# CUDA launchers (the chunked kernels at a given config, the recurrent kernel)
# ---------------------------------------------------------------------------------------------


def default_chunk_config(B, T, H, K, V, dtype, vector_gate: bool, device) -> kconfigs.ChunkConfig:
    return kconfigs.default_config(B, T, H, K, V, dtype, vector_gate, device)


def chunk_fwd_kernel(q, k, v, g, *, scale: float, h0=None, output_final_state: bool = False, config=None):
    """The chunked forward's Triton kernels at ``config`` (None: the default): (o, ht)."""
    return kchunk.forward(GLACall(q, k, v, g, None, h0, scale, output_final_state), config=config)


def chunk_bwd_kernel(q, k, v, g, do, *, scale: float, config=None):
    """The chunked backward's Triton kernels: (dq, dk, dv, dg, ...)."""
    return kchunk.backward(GLACall(q, k, v, g, scale=scale), do, None, config=config)


def recurrent_kernel(q, k, v, g, *, state_in, state_out, scale: float, config=None, state_indices=None):
    """The fused recurrent (decode) kernel: o; the final state goes to state_out (may be state_in; with
    ``state_indices``, the pool state_in itself)."""
    call = GLACall(q, k, v, g, initial_state=state_in, scale=scale, state_indices=state_indices)
    return krecurrent.forward(call, state_out, config=config)


def local_kernel(cfg, q, k, v, g, *, scale: float):
    """gla_chunk_local alone (the local schedule's chunk-parallel first kernel): (qs, ks, A, dl)."""
    run = kchunk._Launcher(cfg, GLACall(q, k, v, g, scale=scale))
    return run.local(q, k, transpose=False)


def dqkg_kernel(cfg, gate_fn: GateFn, *, q, k, v, g, do, h, dh, dq, dk, dg, scale: float):
    """gla_chunk_bwd_dqkg alone, on given per-chunk states h and dh [B, NT, H, K, V]."""
    run = kchunk._Launcher(cfg, GLACall(q, k, v, g, scale=scale, gate=gate_fn))
    run.dqkg(dq, q=q, k=k, v=v, do=do, h=h, dh=dh, dk=dk, dg=dg)


# ---------------------------------------------------------------------------------------------
# patches of the kernels' choices and sources (each undone on exit)
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _patched(module, **attrs):
    old = {name: getattr(module, name) for name in attrs}
    for name, value in attrs.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


def local_slices(bks: int, bkp: int, preload: bool):
    """gla_chunk_local's key slices: BKS keys per slice of the common path, BKP of the steep
    chunks' pairwise path, and whether q and k load before the gate sums."""
    return _patched(kconfigs, local_key_slice=lambda BK: min(BK, bks),
                    local_steep_slice=lambda BKS: min(BKS, bkp), local_preload=lambda BK, BKS: preload)


@contextlib.contextmanager
def f32_precision(precision: str):
    """Every default chunk config with fp32 dots in ``precision`` ("ieee", "tf32", "tf32x3")."""
    real = kconfigs.default_config
    with _patched(kconfigs, default_config=lambda *a, **kw: dataclasses.replace(real(*a, **kw),
                                                                                    f32_precision=precision)):
        yield


@contextlib.contextmanager
def patched_templates(patches: list):
    """Template sources with plain-text replacements (template name, old, new); each ``old`` must be
    found. The rendered-kernel cache is cleared on entry and exit."""
    original = standalone.load_template

    def load(name):
        src = original(name)
        for template, old, new in patches:
            if template == name:
                if old not in src:
                    raise ValueError(f"{old!r} is not in template {name}: the ablation is out of date")
                src = src.replace(old, new)
        return src

    standalone._render_cached.cache_clear()
    try:
        with _patched(standalone, load_template=load):
            yield
    finally:
        standalone._render_cached.cache_clear()


@contextlib.contextmanager
def launch_via_triton():
    """Eager kernels launched through ``JITFunction.run`` every time (binding, specialization and
    cache lookup), instead of the standalone kernels' direct launches of compiled kernels."""
    direct = standalone.StandaloneKernel.__call__

    def via_triton(self, *a, **kw):
        self.compiled.clear()
        return direct(self, *a, **kw)

    with _patched(standalone.StandaloneKernel, __call__=via_triton):
        yield


def sm90_kernel_options(mode_template: str, cfg, dtype, K: int, gate: str, gate_fn: GateFn, extra: dict) -> dict:
    """The jinja options and constexprs a template is rendered with at ``cfg`` (sm90 offline compile)."""
    options = kconfigs.kernel_options(cfg, dtype, K, gate, K**-0.5, False, False, gate_fn)
    options.update(extra)
    if mode_template == "gla_chunk_local":
        options = kconfigs.local_options(options, extra["TRANSPOSE"], cfg.local_tile.num_warps)
    if mode_template == "gla_chunk_bwd_dqkg":
        options["BK"] = kconfigs.dqkg_block_k(cfg, options)
    return options


# ---------------------------------------------------------------------------------------------
# CPU implementations
# ---------------------------------------------------------------------------------------------


def cpu_step_forward(q, k, v, g, *, scale: float):
    """The C++ step loop's forward (fp32 out and state)."""
    return step_loop.forward(GLACall(q, k, v, g, scale=scale))


def cpu_step_backward(q, k, v, g, do, *, scale: float):
    return step_loop.backward(GLACall(q, k, v, g, scale=scale), do, None)


def chunked_forward_torch(q, k, v, g, *, scale: float):
    """The chunked PyTorch forward (the CPU fallback and fp64 path)."""
    return _chunk_fwd_torch(q, k, v, g, None, None, scale, False, False)


def chunked_backward_torch(q, k, v, g, do, *, scale: float):
    return _chunk_bwd_torch(q, k, v, g, None, None, do, None, scale, False)


def cpu_backward_gates(gates: tuple):
    """The gate kinds whose CPU backward takes the step loop (the others: the chunked one)."""
    return _patched(step_loop, BACKWARD_GATES=gates)


@contextlib.contextmanager
def backend_listener(fn):
    """fn(gm, rewrite_result) called after each graph the backend rewrites."""
    _listeners.append(fn)
    try:
        yield
    finally:
        del _listeners[next(i for i, x in enumerate(_listeners) if x is fn)]
