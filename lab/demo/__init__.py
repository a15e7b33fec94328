"""The CPU proof on the real engine: megatron-core's interleaved schedule, DDP with aligned
overlapped param all-gathers, the DistributedOptimizer and reference FP8 weights, over gloo."""
