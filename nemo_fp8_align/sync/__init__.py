"""Finishing one model chunk's parameter all-gather (the ``ChunkParamSync`` protocol of
:mod:`nemo_fp8_align.core.aligner`), one module per distributed optimizer: megatron-core's DDP
bucket groups (``mcore``) and Apex's ``DistributedFusedAdam`` as NeMo uses it (``apex``)."""
