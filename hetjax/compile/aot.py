"""Ahead-of-time compilation with abstract inputs, and what the compiler reports."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


def abstract(tree, shardings):
    """ShapeDtypeStructs carrying shardings: a stand-in for arrays that were never made."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compile(jitted, *abstract_args):
    """Lowers and compiles `jitted` for abstract arguments; allocates nothing."""
    return jitted.lower(*abstract_args).compile()


def analysis(compiled) -> dict[str, float]:
    """Per-device bytes and FLOPs, as the compiler reports them."""
    out: dict[str, float] = {}
    mem = compiled.memory_analysis()
    if mem is not None:
        for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                      "temp_size_in_bytes", "generated_code_size_in_bytes"):
            out[field.removesuffix("_size_in_bytes") + "_bytes"] = float(getattr(mem, field, 0))
        # Donated arguments alias outputs: count those bytes once.
        out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                             + out["temp_bytes"])
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    if cost:
        out["flops"] = float(cost.get("flops", 0.0))
        out["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
    return out


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything needed to lower a config's steps on a mesh, all abstract."""

    cfg: Any
    mesh: Any
    tx: Any
    graphdef: Any
    state: Any  # TrainState of ShapeDtypeStructs
    state_shardings: Any
    batch_shardings: dict
    layouts: list  # sharding.ParamLayout per parameter
    plan: Any = None  # hetjax.pipeline's Plan when config.mesh.pipeline > 1
    rules: tuple = ()  # the sharding rules in force (the pipeline adds "layers" -> pipeline)


def program(cfg, mesh) -> Program:
    """Checks that the model splits over `mesh` (ConfigError naming the field if not),
    then builds the abstract state and its shardings. Allocates nothing."""
    from hetjax import optim, pipeline, sharding, step
    from hetjax import state as state_lib
    plan = pipeline.make_plan(cfg, mesh)  # None unless config.mesh.pipeline > 1
    rules = pipeline.rules(cfg, plan)
    sharding.check_divisible(pipeline.dims(cfg, plan), rules, mesh)
    tx = optim.make_optimizer(cfg.optim, cfg.steps)
    graphdef, state = pipeline.abstract_state(cfg, tx, plan)
    layouts = sharding.param_layouts(state.params, mesh, rules)
    return Program(cfg, mesh, tx, graphdef, state, state_lib.state_shardings(state, mesh, rules),
                   step.batch_shardings(mesh, rules), layouts, plan, rules)
