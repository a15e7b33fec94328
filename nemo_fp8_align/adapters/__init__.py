"""One adapter per distributed optimizer that owns the parameter all-gather: each is one object
(:class:`~nemo_fp8_align.core.adapter.Adapter`) that hears the schedule's launches and step end
and finishes a chunk's all-gather at its aligned slot.

* ``mcore_ddp``: megatron-core DDP chunks (>= 0.9; Megatron-LM, Megatron-Bridge, NeMo's
  ``mcore_distributed_optim``, user loops), with the forced-sync watch of < 0.18;
* ``mcore_optimizer``: megatron-core 0.7/0.8's DistributedOptimizer chain;
* ``apex``: Apex's ``DistributedFusedAdam`` (NeMo's ``distributed_fused_adam``);
* ``groups``: this rank's pipeline and data-parallel rank and size, from the model's groups.

:func:`nemo_fp8_align.assemble.assemble` picks one.
"""
