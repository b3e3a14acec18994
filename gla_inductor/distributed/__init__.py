"""GLA beyond one device, on torch.distributed: DTensor sharding rules for the ops (heads, batch)
and context parallelism over time (``context_parallel_gla``).

Importing this package registers the sharding rules, after which ``gla_inductor.chunk_gla`` and the
ops accept DTensors sharded over heads or batch (``tensor_parallel``), and the GLA rewrite turns a
naive GLA on DTensors sharded over time into ``context_parallel_gla``.
"""

from ..recognize.core.placement_dtensor import register_time_sharded
from .context_parallel import chunk_fwd_over_time, context_parallel_gla
from .tensor_parallel import register_gla_sharding

register_gla_sharding()
# a naive GLA rewritten on DTensors sharded over time runs as context parallelism
register_time_sharded(chunk_fwd_over_time)

__all__ = ["context_parallel_gla", "register_gla_sharding"]
