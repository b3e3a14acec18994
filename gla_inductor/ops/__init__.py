"""The GLA custom ops (``gla_inductor::chunk_fwd``, ``chunk_bwd``, ``fused_recurrent``), the one
dispatch that runs them on every device, and the public functions that call them."""

from .api import chunk_gla, fused_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla"]
