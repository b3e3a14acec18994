"""gla_inductor: a torch.compile backend that runs naive Gated Linear Attention as fused kernels.

    model = torch.compile(model, backend=gla_inductor.backend)

Logs go to the "gla_inductor" logger; TORCH_LOGS="gla_inductor" shows them.
"""

import torch

from . import config
from .backend import backend
from .contract import LayoutWarning
from .explain import explain
from .ops import chunk_gla, fused_recurrent_gla
from .ops.chunk import on_first_trace


def _register_lowerings() -> None:
    """Inductor lowers our ops with ``gla_inductor.lowerings``. A graph reaches Inductor only after
    its ops were traced through their fake implementations, which call this first: importing
    Inductor with the package itself would slow every ``import gla_inductor``."""
    from . import lowerings  # noqa: F401


on_first_trace(_register_lowerings)

if torch.distributed.is_available():
    # the ops' sharding rules, so that they run on DTensors (gla_inductor.distributed)
    from . import distributed  # noqa: F401

__all__ = ["LayoutWarning", "backend", "chunk_gla", "config", "explain", "fused_recurrent_gla"]
