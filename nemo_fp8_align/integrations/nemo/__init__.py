"""NeMo 1.x ``MegatronGPTModel``: one wiring (``session``) behind two ways to turn it on, the
Lightning callback (``callback``, also loaded by the ``callbacks_factory`` entry point) and the
model mixin (``mixin``); building the aligner (``build``), the megatron-core 0.12.3 bucket
workaround and the logger metrics."""
