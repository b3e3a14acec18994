"""Inductor lowerings of the GLA ops. Importing this package registers them (``register_lowering``
is global), for our backend and for plain ``torch.compile`` graphs that call the ops directly."""

from . import chunk  # noqa: F401  (registers the chunk_fwd / chunk_bwd lowerings)
from . import recurrent  # noqa: F401  (registers the fused_recurrent lowering)
from ..cache_key import key_plain_compiles

key_plain_compiles()
