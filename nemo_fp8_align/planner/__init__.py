"""An event-level model of megatron-core's interleaved 1F1B step with the parameter
all-gathers and the post-all-gather work (FP8 weight transposes) on the timeline, calibrated
from sizes and rates or from measured per-chunk durations."""

from nemo_fp8_align.planner.measured import measured_costs
from nemo_fp8_align.planner.program import Placement
from nemo_fp8_align.planner.simulate import ChunkCosts, Costs, Interval, Timeline, simulate

__all__ = ["Placement", "ChunkCosts", "Costs", "Interval", "Timeline", "measured_costs", "simulate"]
