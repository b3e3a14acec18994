"""GLA beyond one device, on torch.distributed: DTensor sharding rules for the ops (heads, batch)
and context parallelism over time (``context_parallel_gla``).

Importing this package registers the sharding rules, after which ``gla_inductor.chunk_gla`` and the
ops accept DTensors sharded over heads or batch (``tensor_parallel``).
"""

from .context_parallel import context_parallel_gla
from .tensor_parallel import register_gla_sharding

register_gla_sharding()

__all__ = ["context_parallel_gla", "register_gla_sharding"]
