"""Where the engine plugs into training loops: megatron-core's (``megatron``: the
``align_fp8_transposes`` entry point) and NeMo 1.x ``MegatronGPTModel`` (``nemo``)."""
