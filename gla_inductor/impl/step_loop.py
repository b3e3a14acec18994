"""The ops on CPU: the recurrence as step loops in C++ (``csrc/recurrent_cpu.cpp``).

Why not the chunked PyTorch forward: at K = V = 64 its batched matmuls alone cost more than the
whole step loop, which does one multiply and two fused multiply-adds per state element and step, on
a state tile that stays in L1, with no intermediates (measurements: benchmarks/results/README.md,
the cpu benchmark). It computes what the time loop computes, step by step, so non-finite inputs and
growing gates give the loop's own results.

The backward walks the recurrence back in time, re-walking the states chunk by chunk from the ones
kept entering each chunk. The ops take it for vector gates only (``BACKWARD_GATES`` says why).

The source is compiled on first use with the system's C++ compiler (the one Inductor's CPU backend
needs too), into a per-user cache directory keyed by the source, the compiler and the flags, and
loaded with ctypes. Where that fails, or for fp64 (the oracles' dtype, kept to the chunked path
written in PyTorch), ``forward_unsupported_reason`` / ``backward_unsupported_reason`` say why, and
dispatch takes the chunked implementation.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import torch
from torch import Tensor

from .. import config
from ..contract import GLACall, sum_groups
from . import scratch, varlen

log = logging.getLogger("gla_inductor")

SOURCE = pathlib.Path(__file__).parent / "csrc" / "recurrent_cpu.cpp"

# Tried in order until one compiles: -march=native for the machine's vector width, -fopenmp for
# its cores. A compiler without OpenMP still gives a (single-threaded) kernel.
_FLAG_SETS = (
    ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"],
    ["-O3", "-ffp-contract=fast", "-fopenmp"],
    ["-O3", "-ffp-contract=fast"],
)


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("GLA_INDUCTOR_CACHE_DIR")
    if root:
        return pathlib.Path(root)
    try:
        user = os.getlogin()
    except OSError:
        user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return pathlib.Path(tempfile.gettempdir()) / f"gla_inductor_{user}"


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _machine() -> str:
    """What -march=native compiles for: a library built for one CPU may not run on another that
    shares the cache directory."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def compile_library(compiler: str, cache_dir: pathlib.Path) -> pathlib.Path:
    """The path of the compiled library, built unless the cache holds it. Raises RuntimeError with
    the compiler's message when no flag set compiles."""
    source = SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    cache_dir.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags in _FLAG_SETS:
        key = hashlib.sha256(repr((source, compiler, version, flags, _machine())).encode()).hexdigest()[:20]
        path = cache_dir / f"recurrent_cpu_{key}.so"
        if path.exists():
            return path
        # built under a name of its own, then renamed: processes compiling at once never load a
        # half-written file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        cmd = [compiler, *flags, "-std=c++17", "-shared", "-fPIC", str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode == 0:
            os.replace(tmp, path)
            return path
        os.unlink(tmp)
        errors.append(f"{' '.join(cmd)}:\n{done.stderr.strip()[-2000:]}")
    raise RuntimeError("could not compile the CPU kernel:\n" + "\n".join(errors))


def load(compiler: Optional[str], cache_dir: pathlib.Path) -> Optional[ctypes.CDLL]:
    """The kernel's library, or None, with a warning, where it cannot be built or loaded."""
    try:
        if compiler is None:
            raise RuntimeError("no C++ compiler found (set CXX)")
        lib = ctypes.CDLL(str(compile_library(compiler, cache_dir)))
    except Exception as e:  # any failure: the chunked PyTorch forward still works
        log.warning("gla_inductor: the CPU forward kernel is unavailable, using the chunked PyTorch "
                    "forward: %s", e)
        return None
    shape_and_strides = [ctypes.POINTER(ctypes.c_int64)] * 2
    lib.gla_recurrent_forward.restype = ctypes.c_int
    lib.gla_recurrent_forward.argtypes = [ctypes.c_void_p] * 6 + shape_and_strides + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.gla_recurrent_backward.restype = ctypes.c_int
    lib.gla_recurrent_backward.argtypes = [ctypes.c_void_p] * 13 + shape_and_strides + [
        ctypes.c_float, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.gla_recurrent_backward_work.restype = ctypes.c_int64
    lib.gla_recurrent_backward_work.argtypes = [ctypes.c_int64] * 4
    return lib


@functools.cache
def library() -> Optional[ctypes.CDLL]:
    return load(_compiler(), _cache_dir())


def available() -> bool:
    return config.cpu_kernel and library() is not None


def _fp32(x: Tensor) -> Tensor:
    """x in fp32 with a contiguous last dimension (the kernel's only layout requirement)."""
    x = x.float()
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _decay(g: Optional[Tensor], g_gamma: Optional[Tensor]) -> tuple[Optional[Tensor], tuple]:
    """exp of the log gate, and its strides over (batch, step, head, key): 0 where it is shared."""
    if g is not None:
        # exp2 of g in log2 units: about half exp's time, for a relative error of |g| * 2^-24
        # more in a step's decay
        a = torch.mul(g.float(), 1 / math.log(2)).exp2_()
        return a, (*a.stride()[:3], a.stride(3) if g.dim() == 4 else 0)
    if g_gamma is not None:
        a = g_gamma.float().exp()
        return a, (0, 0, a.stride(0), 0)
    return None, (0, 0, 0, 0)


def _fits(q, k, v, g, g_gamma, initial_state, **_) -> bool:
    """Whether the inputs have the shapes the kernel indexes by. The ops can be called directly with
    any tensors; the kernel would read out of bounds where the chunked forward raises an error."""
    if q.dim() != 4 or v.dim() != 4 or k.shape != q.shape:
        return False
    B, T, G, K = q.shape
    H = v.shape[2]
    expected = [(v, (B, T, H, v.shape[3])), (g, (B, T, H, K) if g is not None and g.dim() == 4 else (B, T, H)),
                (g_gamma, (H,)), (initial_state, (B, H, K, v.shape[3]))]
    shapes_ok = all(x is None or tuple(x.shape) == shape for x, shape in expected)
    tensors = [x for x in (q, k, v, g, g_gamma, initial_state) if x is not None]
    return shapes_ok and (G == H or G > 0 and H % G == 0) and all(x.layout == torch.strided for x in tensors)


def _ptr(x: Optional[Tensor]) -> Optional[int]:
    return None if x is None else x.data_ptr()


def _initial_state(initial_state: Optional[Tensor], shape: tuple) -> Tensor:
    """The first state as a fresh contiguous fp32 tensor, which the forward walks in place."""
    if initial_state is None:
        return torch.zeros(shape, dtype=torch.float32)
    # copy_, not .to(memory_format=...): that returns an expanded (stride 0) tensor as it is
    return torch.empty(shape, dtype=torch.float32).copy_(initial_state)


def _shape_and_strides(q: Tensor, k: Tensor, v: Tensor, a_strides: tuple, o: Tensor):
    """The kernels' shape (B, T, H, K, V, heads of v per head of q) and strides (q, k, v over
    (batch, step, head), the decay's over (batch, step, head, key), o's over (batch, step, head))."""
    B, T, G, K = q.shape
    H, V = v.shape[2], v.shape[3]
    shape = (ctypes.c_int64 * 6)(B, T, H, K, V, H // G if G else 1)
    strides = (ctypes.c_int64 * 16)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *a_strides, *o.stride()[:3])
    return shape, strides


def _threads(units: int) -> int:
    return max(1, min(torch.get_num_threads(), units))


def forward_unsupported_reason(call: GLACall) -> Optional[str]:
    """None where the step loop runs this forward, else why not (see the module docstring)."""
    if call.varlen:
        call = varlen.one_sequence(call)
    if call.state_dtype != torch.float32:
        return "fp64 runs the chunked algorithm (the oracles' dtype)"
    if call.q.device.type != "cpu":
        return f"device {call.q.device.type}"
    if not _fits(**call.tensors()):
        return "the inputs' shapes do not fit together"
    if not available():
        return "the CPU kernel is off or could not be built"
    return None


@torch.no_grad()
def forward(call: GLACall) -> tuple[Tensor, Tensor]:
    """(o, final state or an empty tensor) like ``chunked.forward``, from the step loop, for a call
    with a log gate where ``forward_unsupported_reason`` is None. q and k may have grouped heads;
    packed sequences run one after another (``varlen``)."""
    if call.varlen:
        return varlen.forward(call, forward)
    q, k, v, g, g_gamma = call.q, call.k, call.v, call.g, call.g_gamma
    B, T, G, K = q.shape
    H, V = v.shape[2], v.shape[3]
    q, k, v = _fp32(q), _fp32(k), _fp32(v)
    a, a_strides = _decay(g, g_gamma)
    o = torch.empty(B, T, H, V, dtype=torch.float32)
    state = _initial_state(call.initial_state, (B, H, K, V))
    shape, strides = _shape_and_strides(q, k, v, a_strides, o)
    library().gla_recurrent_forward(_ptr(q), _ptr(k), _ptr(v), _ptr(a), _ptr(o), _ptr(state), shape, strides,
                                    call.scale, int(call.reverse), _threads(B * H * -(-V // 32)))
    out_dtype = call.output_dtype
    o = o if out_dtype == torch.float32 else o.to(out_dtype)
    return o, (state if call.output_final_state else q.new_empty(0, dtype=torch.float32))


def _gate_grads(dg: Optional[Tensor], q: Tensor, g: Optional[Tensor], g_gamma: Optional[Tensor]):
    """(dg, dg_gamma) shaped and typed like g and g_gamma from the per-key dg [B, T, H, K]; an empty
    tensor for an absent input (``chunked._split_gate_grad``'s convention)."""
    if g is not None:
        return (dg if g.dim() == 4 else dg.sum(-1)).to(g.dtype), q.new_empty(0)
    if g_gamma is not None:
        return q.new_empty(0), dg.sum((0, 1, 3)).to(g_gamma.dtype)
    return q.new_empty(0), q.new_empty(0)  # two tensors: an op's outputs may not alias each other


# Gate kinds whose backward takes the step loop: it halved the chunked backward's time with a vector
# gate, but was no faster with the others, where each row's three sums over V (dq, dk, dg) cost
# about as much as the row's own work at V = 64 (benchmarks/results/cpu-2026-11-23-step-loop.md).
BACKWARD_GATES = ("vector",)


def backward_unsupported_reason(call: GLACall, do: Tensor, dht: Optional[Tensor]) -> Optional[str]:
    """None where the step loop runs this backward, else why not."""
    if call.varlen:
        call, dht = varlen.one_sequence(call), None if dht is None else dht[:1]
    if call.gate_kind not in BACKWARD_GATES:
        return f"{call.gate_kind} gates take the chunked backward (BACKWARD_GATES)"
    q, v = call.q, call.v
    B, T, G, K = q.shape
    if any(x is not None and x.dtype == torch.float64 for x in (*call.tensors().values(), do, dht)):
        return "fp64 runs the chunked algorithm (the oracles' dtype)"
    if q.device.type != "cpu":
        return f"device {q.device.type}"
    if not _fits(**call.tensors()) or do.shape != v.shape or \
            dht is not None and tuple(dht.shape) != (B, v.shape[2], K, v.shape[3]):
        return "the inputs' shapes do not fit together"
    if not available():
        return "the CPU kernel is off or could not be built"
    return None


@torch.no_grad()
def backward(call: GLACall, do: Tensor, dht: Optional[Tensor]) -> tuple[Tensor, ...]:
    """(dq, dk, dv, dg, dg_gamma, dh0) like ``chunked.backward``, from the step loop run back in
    time, where ``backward_unsupported_reason`` is None."""
    if call.varlen:
        return varlen.backward(call, do, dht, backward)
    q, k, v, g, g_gamma, initial_state = call.q, call.k, call.v, call.g, call.g_gamma, call.initial_state
    B, T, G, K = q.shape
    H, V = v.shape[2], v.shape[3]
    q32, k32, v32, do32 = _fp32(q), _fp32(k), _fp32(v), _fp32(do).contiguous()
    a, a_strides = _decay(g, g_gamma)
    dq, dk, dg = (torch.empty(B, T, H, K) for _ in range(3))
    dv, dh0 = torch.empty(B, T, H, V), torch.empty(B, H, K, V)
    state = _initial_state(initial_state, (B, H, K, V))
    dht32 = None if dht is None else dht.float().contiguous()  # autograd's dht may be expanded
    shape, strides = _shape_and_strides(q32, k32, v32, a_strides, dv)
    # states kept while walking back: one entering each chunk of `chunk` steps, and one chunk's
    # states at a time; sqrt(T) keeps both small
    chunk = max(8, min(64, math.isqrt(max(T, 1))))
    threads = _threads(B * H)
    # kept between calls (scratch.py says why)
    work = scratch.empty("cpu_backward_work", (threads * library().gla_recurrent_backward_work(T, K, V, chunk),),
                         torch.float32, q.device)
    library().gla_recurrent_backward(
        _ptr(q32), _ptr(k32), _ptr(v32), _ptr(a), _ptr(state), _ptr(do32), _ptr(dht32), _ptr(dq), _ptr(dk),
        _ptr(dv), _ptr(dg if a is not None else None), _ptr(dh0), _ptr(work), shape, strides, call.scale,
        int(call.reverse), chunk, threads)
    return (
        sum_groups(dq, G, q.dtype),
        sum_groups(dk, G, k.dtype),
        dv.to(v.dtype),
        *_gate_grads(dg, q, g, g_gamma),
        q.new_empty(0) if initial_state is None else dh0.to(initial_state.dtype),
    )
