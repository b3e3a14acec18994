"""gla_inductor: a torch.compile backend that runs naive Gated Linear Attention as fused kernels.

    model = torch.compile(model, backend=gla_inductor.backend)
"""

from . import config
from .backend import backend
from .explain import explain
from .ops import chunk_gla, register_cuda_impl

__all__ = ["backend", "chunk_gla", "config", "explain", "register_cuda_impl"]
