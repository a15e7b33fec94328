"""Stand-ins for libraries that cannot be installed here (Apex; Transformer Engine, which does
not import without CUDA)."""
