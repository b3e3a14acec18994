"""gla_inductor: a torch.compile backend that runs naive Gated Linear Attention as fused kernels.

    model = torch.compile(model, backend=gla_inductor.backend)

Logs go to the "gla_inductor" logger; TORCH_LOGS="gla_inductor" shows them.
"""

from . import config
from .backend import backend
from .explain import explain
from .cuda_dispatch import chunk_bwd_cuda, chunk_fwd_cuda, fused_recurrent_cuda
from .decode import fused_recurrent_gla
from .decode import register_cuda_impl as _register_decode_cuda_impl
from .ops import chunk_gla, register_cuda_impl

# CUDA tensors run the Triton kernels (imported on first use, not here).
register_cuda_impl(fwd=chunk_fwd_cuda, bwd=chunk_bwd_cuda)
_register_decode_cuda_impl(fused_recurrent_cuda)

__all__ = ["backend", "chunk_gla", "config", "explain", "fused_recurrent_gla", "register_cuda_impl"]

