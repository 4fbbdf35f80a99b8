"""The pipeline inside one island: one jitted program in which the `pipeline`
mesh axis is manual (jax.shard_map) and data/fsdp/tensor stay automatic, so a
stage is sharded by the same logical rules as the whole model.

Each tick of the schedule, every stage looks up its row of the schedule table
by its own index (lax.axis_index), runs at most one forward and one backward
(lax.switch: idle slots cost nothing), and exchanges activations and their
gradients with its neighbours (lax.ppermute). A backward recomputes the stage
from its stashed input (jax.vjp), so a stage holds only the inputs of the
micro-batches in flight (Schedule.in_flight sizes the stash): M for GPipe, at
most S-1 for 1F1B, 2S-3 for 1F1B fused. A tick lasts as long as the slowest
stage's branches. Parameter gradients accumulate in the scan carry; the
optimizer step is the unpipelined one.

The embedding and the loss head are replicated over `pipeline` (still sharded by
fsdp/tensor): their weights and Adam moments sit on every stage, but only the
first stage runs the embedding and only the last the head (switch branches), and
their gradients are summed over stages once per step.

XLA workaround: when two of data/fsdp/tensor are larger than 1, XLA's SPMD
partitioner (jax 0.10) aborts on gathers inside the partially manual program
(spmd_partitioner_util ExpandDeviceGroupsWithIota). Stages then embed with a
one-hot matmul (2*V*D FLOPs per token on the first stage, like the unembedding)
and pick label logits with a one-hot product instead of gathers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hetjax import sharding, step
from hetjax.errors import ConfigError
from hetjax.pipeline.schedule import Schedule, forward_only, make_schedule
from hetjax.pipeline.stages import StageLayout, make_layout, map_blocks, stage_backward, stage_forward

AXIS = "pipeline"


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: Schedule
    layout: StageLayout

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    @property
    def slots(self) -> int:
        return max(1, int(self.schedule.in_flight().max()))

    def describe(self) -> str:
        return (f"pipeline: {self.schedule.kind}, {self.stages} stages of {self.layout.stage_layers} "
                f"layers, {self.microbatches} micro-batches, {self.schedule.ticks} ticks; predicted "
                f"bubble {self.schedule.bubble_fraction():.1%}; at most {self.slots} stashed "
                f"stage inputs per stage")


def make_plan(cfg, mesh: Mesh) -> Plan | None:
    """The config's pipeline on this mesh, or None when mesh.pipeline is 1."""
    S = mesh.shape[AXIS]
    if S == 1:
        return None
    M = cfg.pipeline.microbatches
    layout = make_layout(cfg.model.num_layers, S, cfg.pipeline.stage_layers)
    if cfg.batch_size % M:
        raise ConfigError(
            f"config.batch_size={cfg.batch_size} is not divisible by config.pipeline.microbatches="
            f"{M}; make the batch a multiple of the micro-batch count")
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if (cfg.batch_size // M) % shards:
        raise ConfigError(
            f"a micro-batch of config.batch_size/config.pipeline.microbatches = "
            f"{cfg.batch_size}/{M} = {cfg.batch_size // M} rows does not split over data x fsdp = "
            f"{shards} devices; raise config.batch_size or lower config.pipeline.microbatches")
    return Plan(make_schedule(cfg.pipeline.schedule, S, M), layout)


def sharding_rules(rules) -> tuple:
    """The rules with the stacked `layers` axis split over the pipeline stages."""
    for name, target in rules:
        targets = () if target is None else (target,) if isinstance(target, str) else target
        if AXIS in targets and name != "layers":
            raise ConfigError(
                f"config.sharding.rules maps {name!r} to the {AXIS!r} mesh axis; only the stacked "
                f"'layers' axis is split over pipeline stages")
    return tuple((name, AXIS if name == "layers" else target) for name, target in rules)


def _specs(params):
    return map_blocks(lambda _: P(AXIS), params, other=lambda _: P())


def _inside(body, rules):
    # Inside shard_map the context mesh has `pipeline` manual; constraints (and
    # their transposes in a vjp) must name that mesh, not the outer one.
    def wrapped(*args):
        with sharding.logical_rules(jax.sharding.get_abstract_mesh(), rules):
            return body(*args)
    return wrapped


def _stage_setup(graphdef, plan: Plan, params, micro):
    """Inside the shard_map: (this stage's index, its valid layers or None, pick(m) ->
    micro-batch m (any m < 0 picks 0), a zero stage activation)."""
    s = jax.lax.axis_index(AXIS)
    valid = jnp.asarray(plan.layout.valid())[s] if plan.layout.padded else None

    def pick(m):
        return jax.tree.map(lambda v: v[jnp.maximum(m, 0)], micro)

    act = jax.eval_shape(lambda: stage_forward(graphdef, params, None, pick(0), first=True,
                                               last=False, valid=valid))
    return s, valid, pick, jnp.zeros(act.shape, act.dtype)


def _run_stages(body, mesh: Mesh, rules, plan: Plan, params, batch, out_specs):
    """body(params, micro-batches) on every stage: `pipeline` manual, the other axes automatic."""
    with sharding.logical_rules(mesh, rules):
        micro = jax.tree.map(lambda x: step.split_micro(x, plan.microbatches), batch)
        return jax.shard_map(_inside(body, rules), mesh=mesh, in_specs=(_specs(params), P()),
                             out_specs=out_specs, axis_names={AXIS}, check_vma=False)(params, micro)


def _gather_free(mesh: Mesh) -> bool:
    return sum(mesh.shape[a] > 1 for a in ("data", "fsdp", "tensor")) > 1


def _work_table(sched: Schedule) -> tuple[np.ndarray, list[tuple[int, bool, bool]]]:
    """(ticks, stages) int32 index into the (stage kind, forward?, backward?) combinations
    that occur; kind 0/1/2 is the first/a middle/the last stage. The last stage runs no
    separate forward: its backward computes the loss."""
    S = sched.stages
    kind = np.array([0] + [1] * (S - 2) + [2])
    fwd = (sched.forward >= 0) & (kind < 2)
    bwd = sched.backward >= 0
    kind = np.where(fwd | bwd, kind, 0)  # an idle tick is the same on every stage: one branch
    combos = np.stack(np.broadcast_arrays(kind, fwd, bwd), -1).reshape(-1, 3)
    unique, index = np.unique(combos, axis=0, return_inverse=True)
    return (index.reshape(fwd.shape).astype(np.int32),
            [(int(k), bool(f), bool(b)) for k, f, b in unique])


def make_grad_fn(graphdef, mesh: Mesh, rules, plan: Plan):
    """(params in pipeline layout, batch) -> (loss sum, token count, summed gradients)."""
    S, K = plan.stages, plan.slots
    sched = plan.schedule
    work, combos = _work_table(sched)
    tables = tuple(jnp.asarray(t) for t in (sched.forward, sched.backward, sched.arrivals(), work))
    gather_free = _gather_free(mesh)
    to_next = [(i, i + 1) for i in range(S - 1)]
    to_prev = [(i + 1, i) for i in range(S - 1)]

    def body(params, micro):
        s, valid, pick, zeros_act = _stage_setup(graphdef, plan, params, micro)
        zero_grads = jax.tree.map(jnp.zeros_like, params)

        def branch(kind, fwd, bwd):
            def run(x_f, mb_f, x_b, mb_b, dy):
                y = zeros_act
                if fwd:
                    y = stage_forward(graphdef, params, x_f, mb_f, first=kind == 0, last=False,
                                      valid=valid, gather_free=gather_free)
                g, dx, l = zero_grads, zeros_act, jnp.zeros((), jnp.float32)
                if bwd:
                    g, dx, l = stage_backward(graphdef, params, x_b, mb_b, dy, first=kind == 0,
                                              last=kind == 2, valid=valid, gather_free=gather_free)
                return y, g, dx, l
            return run

        branches = [branch(*c) for c in combos]

        def tick(carry, row):
            stash, recv_x, recv_dx, grads, loss = carry
            f, b, arrived, w = (t[s] for t in row)
            # An arriving activation goes into its micro-batch's slot until its backward.
            slot = jnp.maximum(arrived, 0) % K
            stash = jax.lax.dynamic_update_index_in_dim(
                stash, jnp.where(arrived >= 0, recv_x, stash[slot]), slot, 0)
            # One switch runs the tick's forward and backward: the collectives inside
            # (fsdp/tensor) then follow one program order on every device. With two
            # switches the CPU runtime may start either first and deadlock.
            y, g, dx, l = jax.lax.switch(w, branches, stash[jnp.maximum(f, 0) % K], pick(f),
                                         stash[jnp.maximum(b, 0) % K], pick(b), recv_dx)
            grads = jax.tree.map(jnp.add, grads, g)
            recv_x = jax.lax.ppermute(y, AXIS, to_next)
            recv_dx = jax.lax.ppermute(dx, AXIS, to_prev)
            return (stash, recv_x, recv_dx, grads, loss + l), None

        stash = jnp.zeros((K, *zeros_act.shape), zeros_act.dtype)
        init = (stash, zeros_act, zeros_act, zero_grads, jnp.zeros((), jnp.float32))
        (_, _, _, grads, loss), _ = jax.lax.scan(tick, init, tables)
        # Embedding and head gradients come from the first and last stages.
        grads = map_blocks(lambda g: g, grads, other=lambda g: jax.lax.psum(g, AXIS))
        return jax.lax.psum(loss, AXIS), grads

    def grad_fn(params, batch):
        loss, grads = _run_stages(body, mesh, rules, plan, params, batch, (P(), _specs(params)))
        return loss, jnp.sum(batch["loss_mask"].astype(jnp.float32)), grads

    return grad_fn


def make_train_step(graphdef, tx, lr_schedule, mesh: Mesh, rules, plan: Plan):
    """The pipelined counterpart of hetjax.step.make_train_step (same state, same metrics)."""
    grad_fn = make_grad_fn(graphdef, mesh, rules, plan)

    def train_step(state, batch):
        loss_sum, count, grads = grad_fn(state.params, batch)
        return step.apply_gradients(state, tx, lr_schedule, grads, loss_sum, count)

    return train_step


def make_eval_step(graphdef, mesh: Mesh, rules, plan: Plan):
    """Forward only: micro-batch m is on stage s at tick m+s; the last stage adds up the loss."""
    S = plan.stages
    forward_table = jnp.asarray(forward_only(S, plan.microbatches))
    gather_free = _gather_free(mesh)
    to_next = [(i, i + 1) for i in range(S - 1)]

    def body(params, micro):
        s, valid, pick, zeros_act = _stage_setup(graphdef, plan, params, micro)
        kind = jnp.where(s == 0, 0, jnp.where(s == S - 1, 2, 1))
        zero = (zeros_act, jnp.zeros((), jnp.float32))

        def run(first, last):
            def branch(x, mb):
                out = stage_forward(graphdef, params, x, mb, first=first, last=last, valid=valid,
                                    gather_free=gather_free)
                return (zero[0], out) if last else (out, zero[1])
            return branch

        branches = [run(True, False), run(False, False), run(False, True), lambda x, mb: zero]

        def tick(carry, row):
            x, loss = carry
            m = row[s]
            y, l = jax.lax.switch(jnp.where(m >= 0, kind, 3), branches, x, pick(m))
            return (jax.lax.ppermute(y, AXIS, to_next), loss + l), None

        (_, loss), _ = jax.lax.scan(tick, zero, forward_table)
        return jax.lax.psum(loss, AXIS)

    def eval_step(params, batch):
        loss = _run_stages(body, mesh, rules, plan, params, batch, P())
        return {"loss_sum": loss, "tokens": jnp.sum(batch["loss_mask"].astype(jnp.float32))}

    return eval_step
