"""An event-level model of megatron-core's interleaved 1F1B step with the parameter
all-gathers and the FP8 weight transposes on the timeline."""

from nemo_fp8_align.planner.program import Placement
from nemo_fp8_align.planner.simulate import Costs, Interval, Timeline, simulate

__all__ = ["Placement", "Costs", "Interval", "Timeline", "simulate"]
