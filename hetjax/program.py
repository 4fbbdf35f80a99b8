"""(config, mesh) -> the model's graphdef, the optimizer, the sharding rules, the abstract
state and its shardings, the batch shardings, the initial state and the compiled train
and eval steps, pipelined (config.mesh.pipeline > 1) or not.

Everything that builds a step (training, islands, the planner, export, the benches and
the tests) builds it here, so that they all run the same program: `build` is abstract
(nothing allocated), `Program.init_state` allocates, `compile_*` lower and compile.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax import optim, sharding
from hetjax import state as state_lib
from hetjax import step
from hetjax.compile import aot
from hetjax.pipeline.config import check_grad_sync
from hetjax.pipeline.spmd import Plan, make_plan, sharding_rules
from hetjax.pipeline import spmd
from hetjax.pipeline.stages import to_stages
from hetjax.state import TrainState


@dataclasses.dataclass(frozen=True)
class Program:
    """Everything needed to lower a config's steps on a mesh, all abstract."""

    cfg: Any  # hetjax.config.Config
    mesh: Mesh
    tx: optax.GradientTransformation
    graphdef: nnx.GraphDef
    state: TrainState  # of ShapeDtypeStructs
    state_shardings: TrainState  # of NamedShardings
    batch_shardings: dict[str, NamedSharding]
    layouts: list[sharding.ParamLayout]  # one per parameter
    plan: Plan | None = None  # the pipeline's plan when config.mesh.pipeline > 1
    rules: tuple = ()  # the sharding rules in force (the pipeline adds "layers" -> pipeline)

    def init_state(self) -> TrainState:
        """The initial weights, already sharded; a pipeline holds the unpipelined model's
        weights in its layout."""
        return init_state(self.cfg, self.tx, self.state_shardings, self.plan)

    def train_step_fn(self) -> Callable:
        """The pure (state, batch) -> (state, metrics): hetjax.step's, or the pipeline's."""
        return train_step_fn(self.cfg, self.graphdef, self.tx, self.mesh, self.plan)

    def eval_step_fn(self) -> Callable:
        """The pure (params, batch) -> {"loss_sum", "tokens"}, chosen like train_step_fn."""
        return eval_step_fn(self.cfg, self.graphdef, self.mesh, self.plan)

    def jit_train_step(self, fn: Callable | None = None):
        """fn (default train_step_fn()) jitted with this program's shardings, state donated."""
        return jit_train_step(fn or self.train_step_fn(), self.state_shardings, self.batch_shardings, self.mesh)

    def jit_eval_step(self, fn: Callable | None = None):
        """fn (default eval_step_fn()) jitted with this program's shardings."""
        return jit_eval_step(fn or self.eval_step_fn(), self.state_shardings.params, self.batch_shardings,
                             self.mesh)

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        return abstract_batch(self.cfg.batch_size, self.cfg.seq_len, self.batch_shardings)

    def compile_train_step(self):
        """The train step lowered for abstract inputs and compiled (nothing allocated)."""
        return aot.compile(self.jit_train_step(), aot.abstract(self.state, self.state_shardings),
                           self.abstract_batch())

    def compile_eval_step(self):
        """The eval step lowered for abstract inputs and compiled (nothing allocated)."""
        return aot.compile(self.jit_eval_step(), aot.abstract(self.state.params, self.state_shardings.params),
                           self.abstract_batch())


def build(cfg, mesh: Mesh) -> Program:
    """Checks that the model splits over `mesh` (ConfigError naming the field if not),
    then builds the abstract state and its shardings. Allocates nothing."""
    plan = check_splits(cfg, mesh)
    r = rules(cfg, plan)
    tx = optim.make_optimizer(cfg.optim, cfg.steps)
    graphdef, state = abstract_state(cfg, tx, plan)
    layouts = sharding.param_layouts(state.params, mesh, r)
    return Program(cfg, mesh, tx, graphdef, state, state_lib.state_shardings(state, mesh, r),
                   batch_shardings(mesh, r), layouts, plan, r)


def check_splits(cfg, mesh) -> Plan | None:
    """The pipeline plan (None unless config.mesh.pipeline > 1), once the model and the batch
    split over `mesh`: a ConfigError naming the field if not. Reads only mesh.shape, so an
    AbstractMesh checks a layout without its devices."""
    plan = make_plan(cfg, mesh)
    if plan is not None:  # config.mesh.pipeline=-1 is counted here
        check_grad_sync(cfg, f"config.mesh.pipeline={cfg.mesh.pipeline} ({mesh.shape['pipeline']} stages)")
    r = rules(cfg, plan)
    sharding.check_divisible(dims(cfg, plan), r, mesh)
    sharding.check_batch_divisible(cfg.batch_size, cfg.seq_len, r, mesh)  # the inputs' shardings
    if cfg.optim.grad_accum_steps > 1:  # each accumulated micro-batch is split like the batch
        sharding.check_microbatch_rows(cfg.batch_size, cfg.optim.grad_accum_steps, r, mesh.shape,
                                       field="config.optim.grad_accum_steps")
    return plan


def rules(cfg, plan: Plan | None) -> tuple:
    """The config's sharding rules, with the pipeline's "layers" -> pipeline when pipelined."""
    return cfg.sharding.rules if plan is None else sharding_rules(cfg.sharding.rules)


def dims(cfg, plan: Plan | None) -> dict:
    """ModelConfig.dims() with `layers` as the pipeline layout holds them (padded)."""
    out = cfg.model.dims()
    if plan is not None:
        out["layers"] = ("pipeline.stage_layers (padded)", len(plan.layout.source()))
    return out


def abstract_state(cfg, tx, plan: Plan | None) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, TrainState of ShapeDtypeStructs) in the layout `plan` holds them."""
    if plan is None or not plan.layout.reordered:
        return state_lib.abstract_state(cfg.model, cfg.seed, tx)
    graphdef, _ = state_lib.abstract_state(cfg.model, cfg.seed, tx)
    return graphdef, jax.eval_shape(lambda: _init_padded(cfg, tx, plan))


def _init_padded(cfg, tx, plan: Plan) -> TrainState:
    _, params = nnx.split(state_lib.make_model(cfg.model, cfg.seed))
    params = to_stages(params, plan.layout)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def init_state(cfg, tx, shardings: TrainState, plan: Plan | None = None) -> TrainState:
    """The same initial weights as the unpipelined model, in the layout `plan` holds them."""
    if plan is None or not plan.layout.reordered:
        return state_lib.create_state(cfg.model, cfg.seed, tx, shardings)
    return jax.jit(lambda: _init_padded(cfg, tx, plan), out_shardings=shardings)()


def train_step_fn(cfg, graphdef, tx, mesh: Mesh, plan: Plan | None) -> Callable:
    """The pure train step for cfg on mesh: hetjax.step's when plan is None, else the
    pipelined one."""
    r, lr = rules(cfg, plan), optim.learning_rate_schedule(cfg.optim, cfg.steps)
    if plan is None:
        return step.make_train_step(graphdef, tx, lr, mesh, r, cfg.optim.grad_accum_steps, cfg.sharding.grad_sync)
    return spmd.make_train_step(graphdef, tx, lr, mesh, r, plan)


def eval_step_fn(cfg, graphdef, mesh: Mesh, plan: Plan | None) -> Callable:
    """The pure eval step, (params, batch) -> {"loss_sum", "tokens"}, chosen like train_step_fn."""
    r = rules(cfg, plan)
    if plan is None:
        return step.make_eval_step(graphdef, mesh, r, cfg.optim.grad_accum_steps)
    return spmd.make_eval_step(graphdef, mesh, r, plan)


def batch_shardings(mesh: Mesh, rules) -> dict[str, NamedSharding]:
    """Every batch array's sharding: rows over the data axes, as the rules say."""
    spec = sharding.spec_for(step.BATCH_AXES, rules)
    return {k: NamedSharding(mesh, spec) for k in step.BATCH_KEYS}


def abstract_batch(batch_size: int, seq_len: int, shardings: dict) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of ShapeDtypeStructs, to lower a step without data."""
    return {k: jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=s)
            for k, s in shardings.items()}


def jit_train_step(train_step, state_shardings, batch_sharding, mesh: Mesh):
    """jit with explicit in/out shardings and the state donated (updated in place)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated), donate_argnums=0)


def jit_eval_step(eval_step, param_shardings, batch_sharding, mesh: Mesh):
    """jit with explicit in/out shardings; metrics replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(eval_step, in_shardings=(param_shardings, batch_sharding), out_shardings=replicated)
