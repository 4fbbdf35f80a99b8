"""Pipeline parallelism over the `pipeline` mesh axis of one island.

schedule.py  the schedules as data (which micro-batch each stage runs, per tick)
stages.py    the stage layout and one stage's forward / backward
spmd.py      the single-program pipeline: shard_map over `pipeline`, ppermute
setup.py     what the training program calls (state, step, eval for any mesh)
"""

from hetjax.pipeline.schedule import KINDS, Schedule, make_schedule, plot, timeline  # noqa: F401
from hetjax.pipeline.stages import (StageLayout, from_stages, make_layout, stage_backward,  # noqa: F401
                                    stage_forward, stage_params, to_stages)
from hetjax.pipeline.spmd import Plan, make_grad_fn, make_plan, sharding_rules  # noqa: F401
