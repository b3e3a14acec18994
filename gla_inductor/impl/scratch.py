"""Buffers the CPU implementation keeps between calls for its intermediates.

Why: PyTorch's CPU allocator hands every tensor to malloc and back, and glibc returns freed blocks
of this size to the operating system (mmap'd blocks, or a trimmed heap top). The next call then
faults its intermediates back in page by page: at B=2, T=512, H=4, K=V=64 the forward took ~1500
minor page faults per call, ~3 ms on a 2-core VM, more than its computation
(``benchmarks/results/archive/cpu-2026-11-23-scratch.md``). CUDA has its caching allocator.

Each buffer has a name, one per intermediate of a call, and is kept per thread (two threads never
share one). A buffer is a view into storage that the next call with that name overwrites: only
intermediates may live there, never an op's output (``chunked._from_chunks`` always copies). The
total kept per thread is bounded by ``config.cpu_scratch_bytes``; past it, tensors are allocated
as usual.
"""

from __future__ import annotations

import math
import threading

import torch
from torch import Tensor

from .. import config

_local = threading.local()


def _buffers() -> dict[str, Tensor]:
    if not hasattr(_local, "buffers"):
        _local.buffers = {}
    return _local.buffers


def empty(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialized contiguous tensor of shape and dtype on device, kept under name on CPU (an
    empty name: a tensor allocated as usual, so callers need no second path)."""
    if not name or device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    buffers = _buffers()
    numel = math.prod(shape)
    buf = buffers.get(name)
    if buf is None or buf.dtype != dtype or buf.numel() < numel:
        kept = sum(b.nbytes for n, b in buffers.items() if n != name)
        if kept + numel * dtype.itemsize > config.cpu_scratch_bytes:
            return torch.empty(shape, dtype=dtype, device=device)
        buffers.pop(name, None)  # freed before the larger one is taken
        # a normal tensor even under inference mode, which later calls outside it may write
        with torch.inference_mode(False):
            buf = buffers[name] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel].view(shape)


def like(name: str, x: Tensor) -> Tensor:
    """``empty`` shaped like x, in x's dtype and on x's device."""
    return empty(name, tuple(x.shape), x.dtype, x.device)


def clear() -> None:
    """Release this thread's buffers."""
    _buffers().clear()
