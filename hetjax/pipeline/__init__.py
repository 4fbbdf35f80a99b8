"""Pipeline parallelism over the `pipeline` mesh axis of one island.

schedule.py  the schedules as data (which micro-batch each stage runs, per tick)
stages.py    the stage layout and one stage's forward / backward
split.py     a stage's backward cut into input- and weight-gradient parts (islands' split backwards)
spmd.py      the single-program pipeline: shard_map over `pipeline`, ppermute
__main__.py  `python -m hetjax.pipeline --stages 4 --microbatches 8`: a timeline
"""

from hetjax.pipeline.schedule import (KINDS, Schedule, forward_only, island_orders, make_schedule, plot,
                                      timeline)
from hetjax.pipeline.spmd import (Plan, make_eval_step, make_grad_fn, make_plan, make_train_step,
                                  sharding_rules)
from hetjax.pipeline.stages import (StageLayout, from_stages, make_layout, stage_backward,
                                    stage_forward, stage_params, to_stages)

__all__ = [
    "KINDS", "Schedule", "forward_only", "island_orders", "make_schedule", "plot", "timeline", "Plan",
    "make_eval_step",
    "make_grad_fn", "make_plan", "make_train_step", "sharding_rules", "StageLayout", "from_stages", "make_layout",
    "stage_backward", "stage_forward", "stage_params", "to_stages"
]
