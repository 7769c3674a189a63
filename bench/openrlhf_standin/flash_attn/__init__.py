"""A stand-in for the few ``flash_attn`` names OpenRLHF 0.11.2 imports at module level (see ../README.md).

Deliberately no ``__version__`` and no distribution metadata: transformers must not take this for flash-attn.
"""
