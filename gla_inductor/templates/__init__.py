"""Jinja sources of the GLA Triton kernels (``gla_*.py.jinja``) and their standalone renderer."""
