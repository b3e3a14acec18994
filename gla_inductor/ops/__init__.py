"""The GLA custom ops (``gla_inductor::chunk_fwd``, ``chunk_bwd``, ``fused_recurrent``), the one
dispatch that runs them on every device, and the public functions that call them;
``chunk_final_state`` (a run's final state alone, for context parallelism) and the ops of a run cut in
two around an exchange of states (``parts``)."""

from . import final_state  # noqa: F401  (registers gla_inductor::chunk_final_state)
from . import parts  # noqa: F401  (registers gla_inductor::chunk_sums and the ops from its parts)
from .api import chunk_gla, fused_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla"]
