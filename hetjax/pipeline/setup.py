"""What the training program calls to build state and steps for any mesh: with
mesh.pipeline = 1 these are hetjax.state / hetjax.step unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hetjax import state as state_lib
from hetjax import step
from hetjax.optim import learning_rate_schedule
from hetjax.pipeline.spmd import Plan, make_eval_step, make_train_step, sharding_rules
from hetjax.pipeline.stages import to_stages


def build(cfg, mesh):
    """(plan, rules, optimizer, graphdef, state shardings, initial state) for cfg on mesh."""
    from hetjax.optim import make_optimizer
    from hetjax.pipeline.spmd import make_plan
    plan = make_plan(cfg, mesh)
    r = rules(cfg, plan)
    tx = make_optimizer(cfg.optim, cfg.steps)
    graphdef, abstract = abstract_state(cfg, tx, plan)
    shardings = state_lib.state_shardings(abstract, mesh, r)
    return plan, r, tx, graphdef, shardings, create_state(cfg, tx, shardings, plan)


def rules(cfg, plan: Plan | None) -> tuple:
    return cfg.sharding.rules if plan is None else sharding_rules(cfg.sharding.rules)


def dims(cfg, plan: Plan | None) -> dict:
    """ModelConfig.dims() with `layers` as the pipeline layout holds them (padded)."""
    out = cfg.model.dims()
    if plan is not None:
        out["layers"] = ("pipeline.stage_layers (padded)", plan.stages * plan.layout.per_stage)
    return out


def abstract_state(cfg, tx, plan: Plan | None):
    if plan is None or not plan.layout.padded:
        return state_lib.abstract_state(cfg.model, cfg.seed, tx)
    graphdef, _ = state_lib.abstract_state(cfg.model, cfg.seed, tx)
    return graphdef, jax.eval_shape(lambda: _init(cfg, tx, plan))


def _init(cfg, tx, plan: Plan):
    _, params = nnx.split(state_lib.make_model(cfg.model, cfg.seed))
    params = to_stages(params, plan.layout)
    return state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def create_state(cfg, tx, shardings, plan: Plan | None):
    """The same initial weights as the unpipelined model, in the pipeline layout."""
    if plan is None or not plan.layout.padded:
        return state_lib.create_state(cfg.model, cfg.seed, tx, shardings)
    return jax.jit(lambda: _init(cfg, tx, plan), out_shardings=shardings)()


def train_step_fn(cfg, graphdef, tx, mesh, plan: Plan | None):
    """The pure train step for cfg on mesh: hetjax.step's when plan is None, else the
    pipelined one. Everything that builds a step (train, plan, export, benches) chooses here."""
    r, lr = rules(cfg, plan), learning_rate_schedule(cfg.optim, cfg.steps)
    if plan is None:
        return step.make_train_step(graphdef, tx, lr, mesh, r, cfg.optim.grad_accum_steps)
    return make_train_step(graphdef, tx, lr, mesh, r, plan)


def eval_step_fn(cfg, graphdef, mesh, plan: Plan | None):
    """The pure eval step, (params, batch) -> {"loss_sum", "tokens"}, chosen like train_step_fn."""
    r = rules(cfg, plan)
    return step.make_eval_step(graphdef, mesh, r) if plan is None else make_eval_step(graphdef, mesh, r, plan)


def compile_train_step(cfg, graphdef, tx, abstract, shardings, mesh, plan: Plan | None):
    """train_step_fn jitted (state donated), lowered for abstract inputs and compiled."""
    return step.compile_step(step.jit_train_step, train_step_fn(cfg, graphdef, tx, mesh, plan), cfg,
                             abstract, shardings, mesh, rules(cfg, plan))


def compile_eval_step(cfg, graphdef, abstract_params, param_shardings, mesh, plan: Plan | None):
    """eval_step_fn jitted, lowered for abstract inputs and compiled."""
    return step.compile_step(step.jit_eval_step, eval_step_fn(cfg, graphdef, mesh, plan), cfg,
                             abstract_params, param_shardings, mesh, rules(cfg, plan))
