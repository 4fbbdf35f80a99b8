"""The pipeline inside one island: one jitted program in which the `pipeline`
mesh axis is manual (jax.shard_map) and data/fsdp/tensor stay automatic, so a
stage is sharded by the same logical rules as the whole model.

Each tick of the schedule, every stage looks up its row of the schedule table
by its own index (lax.axis_index), runs at most one forward and one backward
(lax.switch: idle slots cost nothing), and exchanges activations and their
gradients with its neighbours (lax.ppermute). A backward recomputes the stage
from its stashed input (jax.vjp), so a stage holds only the inputs of the
micro-batches in flight (Schedule.slots places them in the stash): M for GPipe,
at most S-1 for 1F1B, 2S-3 for 1F1B fused. A tick lasts as long as the slowest
stage's branches. With interleaved stages (config.pipeline.virtual_stages = V) a
stage holds V chunks of layers; a branch runs one chunk (a static slice of the
stage's layers), and the last device's output goes round to the first device.
Parameter gradients accumulate in the scan carry (a chunk's into its rows only);
the optimizer step is the unpipelined one.

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
from hetjax.pipeline.config import check_no_grad_accum, virtual_stages
from hetjax.pipeline.schedule import Schedule, forward_only, make_schedule
from hetjax.pipeline.stages import StageLayout, make_layout, map_blocks, stage_backward, stage_forward

AXIS = "pipeline"


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: Schedule
    layout: StageLayout
    unroll: bool = False  # not config.pipeline.scan_layers

    @property
    def stages(self) -> int:
        return self.schedule.stages

    @property
    def microbatches(self) -> int:
        return self.schedule.microbatches

    @property
    def slots(self) -> int:
        return self.schedule.slots()[3]

    def describe(self) -> str:
        layout = self.layout
        layers = (f"of {layout.stage_layers} layers" if layout.virtual == 1 else
                  f"x {layout.virtual} interleaved chunks of {layout.stage_layers[0]} layers")
        return (f"pipeline: {self.schedule.name}, {self.stages} stages {layers}, {self.microbatches} "
                f"micro-batches, {self.schedule.ticks} ticks; predicted bubble "
                f"{self.schedule.bubble_fraction():.1%}; at most {self.slots} stashed stage inputs per stage")


def make_plan(cfg, mesh: Mesh) -> Plan | None:
    """The config's pipeline on this mesh, or None when mesh.pipeline is 1."""
    S = mesh.shape[AXIS]
    if S == 1:
        p = cfg.pipeline  # config.mesh.pipeline=-1 that came to 1 (an island's mesh may hold no pipeline)
        given = [f"config.pipeline.{k}={v}" for k, v in (("virtual_stages", p.virtual_stages),
                                                         ("stage_layers", tuple(p.stage_layers)))
                 if (k == "virtual_stages" and v > 1) or (k == "stage_layers" and v)]
        if given and not cfg.hetero.islands:
            raise ConfigError(
                f"{' and '.join(given)} with config.mesh.pipeline={cfg.mesh.pipeline}, which is 1 stage on this "
                f"mesh: there are no stages to interleave or split; give config.mesh.pipeline a size > 1, or "
                f"drop {'them' if len(given) > 1 else 'it'}")
        return None
    check_no_grad_accum(cfg, S)  # config.mesh.pipeline=-1 is counted only here
    M, V = cfg.pipeline.microbatches, virtual_stages(cfg, S)
    layout = make_layout(cfg.model.num_layers, S, cfg.pipeline.stage_layers, V)
    if cfg.batch_size % M:
        raise ConfigError(
            f"config.batch_size={cfg.batch_size} is not divisible by config.pipeline.microbatches="
            f"{M}; make the batch a multiple of the micro-batch count")
    sharding.check_microbatch_rows(cfg.batch_size, M, cfg.sharding.rules, mesh.shape)
    return Plan(make_schedule(cfg.pipeline.schedule, S, M, V), layout, unroll=not cfg.pipeline.scan_layers)


def sharding_rules(rules) -> tuple:
    """The rules with the stacked `layers` axis split over the pipeline stages."""
    for name, target in rules:
        targets = sharding.mesh_axes(target)
        if AXIS in targets and name != "layers":
            raise ConfigError(
                f"config.sharding.rules maps {name!r} to the {AXIS!r} mesh axis; only the stacked "
                f"'layers' axis is split over pipeline stages")
        if name == "layers" and targets not in ((), (AXIS,)):  # it was replaced without a word
            raise ConfigError(
                f"config.sharding.rules maps 'layers' to {target!r}, but with config.mesh.pipeline > 1 the "
                f"pipeline stages take the layers; use ('layers', None)")
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
    """Inside the shard_map: (this stage's index, chunk(v) -> (chunk v's parameters, its
    valid layers or None), pick(m) -> micro-batch m (any m < 0 picks 0), a zero stage
    activation)."""
    s = jax.lax.axis_index(AXIS)
    valid = jnp.asarray(plan.layout.valid())[s] if plan.layout.padded else None
    V, C = plan.layout.virtual, plan.layout.per_stage

    def chunk(v):
        if V == 1:
            return params, valid
        cut = slice(v * C, (v + 1) * C)
        return map_blocks(lambda x: x[cut], params), None if valid is None else valid[cut]

    def pick(m):
        return jax.tree.map(lambda v: v[jnp.maximum(m, 0)], micro)

    act = jax.eval_shape(lambda: stage_forward(graphdef, chunk(0)[0], None, pick(0), first=True,
                                               last=False, valid=chunk(0)[1]))
    return s, chunk, pick, jnp.zeros(act.shape, act.dtype)


def _ring(S: int, V: int) -> tuple[list, list]:
    """ppermute pairs forward and backward; round from the last device to the first
    (and back) when stages are interleaved."""
    to_next, to_prev = [(i, i + 1) for i in range(S - 1)], [(i + 1, i) for i in range(S - 1)]
    if V > 1:
        to_next, to_prev = to_next + [(S - 1, 0)], to_prev + [(0, S - 1)]
    return to_next, to_prev


def _kinds(chunks: np.ndarray, S: int, V: int) -> np.ndarray:
    """(ticks, S): 0/1/2 for an operation of the first/a middle/the last virtual stage, -1 none."""
    j = chunks * S + np.arange(S)
    return np.where(chunks < 0, -1, np.where(j == 0, 0, np.where(j == S * V - 1, 2, 1)))


def _run_stages(body, mesh: Mesh, rules, plan: Plan, params, batch, out_specs):
    """body(params, micro-batches) on every stage: `pipeline` manual, the other axes automatic."""
    with sharding.logical_rules(mesh, rules):
        micro = jax.tree.map(lambda x: step.split_micro(x, plan.microbatches), batch)
        return jax.shard_map(_inside(body, rules), mesh=mesh, in_specs=(_specs(params), P()),
                             out_specs=out_specs, axis_names={AXIS}, check_vma=False)(params, micro)


def _add_rows(acc, x, start):
    """acc[start:start + len(x)] += x (start traced)."""
    return jax.lax.dynamic_update_slice_in_dim(
        acc, jax.lax.dynamic_slice_in_dim(acc, start, x.shape[0], 0) + x, start, 0)


def _gather_free(mesh: Mesh) -> bool:
    return sum(mesh.shape[a] > 1 for a in ("data", "fsdp", "tensor")) > 1


def _work_table(sched: Schedule) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """(ticks, stages) int32 index into the (forward kind, forward chunk, backward kind,
    backward chunk) combinations that occur, -1 for no operation; kind 0/1/2 is the
    first/a middle/the last virtual stage. The last runs no separate forward: its
    backward computes the loss."""
    S, V = sched.stages, sched.virtual
    fk, bk = _kinds(sched.forward_chunk, S, V), _kinds(sched.backward_chunk, S, V)
    fc = np.where((fk >= 0) & (fk < 2), sched.forward_chunk, -1)
    fk = np.where(fc >= 0, fk, -1)
    combos = np.stack([fk, fc, bk, sched.backward_chunk], -1).reshape(-1, 4)
    unique, index = np.unique(combos, axis=0, return_inverse=True)
    return index.reshape(fk.shape).astype(np.int32), [tuple(int(c) for c in u) for u in unique]


def make_grad_fn(graphdef, mesh: Mesh, rules, plan: Plan):
    """(params in pipeline layout, batch) -> (loss sum, token count, summed gradients)."""
    S, V, K, C = plan.stages, plan.layout.virtual, plan.slots, plan.layout.per_stage
    sched = plan.schedule
    work, combos = _work_table(sched)
    arrived, _ = sched.arrivals()
    arrive_slot, f_slot, b_slot, _ = sched.slots()
    tables = tuple(jnp.asarray(t) for t in (sched.forward, sched.backward, arrived, arrive_slot, f_slot,
                                            b_slot, work, np.maximum(sched.backward_chunk, 0)))
    gather_free = _gather_free(mesh)
    to_next, to_prev = _ring(S, V)

    def body(params, micro):
        s, chunk, pick, zeros_act = _stage_setup(graphdef, plan, params, micro)
        zero_grads = jax.tree.map(jnp.zeros_like, chunk(0)[0])  # a branch's: one chunk's layers
        is_rows = map_blocks(lambda _: True, params, other=lambda _: False)

        def branch(fkind, fchunk, bkind, bchunk):
            def run(x_f, mb_f, x_b, mb_b, dy):
                y = zeros_act
                if fchunk >= 0:
                    p, valid = chunk(fchunk)
                    y = stage_forward(graphdef, p, x_f, mb_f, first=fkind == 0, last=False,
                                      valid=valid, gather_free=gather_free, unroll=plan.unroll)
                g, dx, l = zero_grads, zeros_act, jnp.zeros((), jnp.float32)
                if bchunk >= 0:
                    p, valid = chunk(bchunk)
                    g, dx, l = stage_backward(graphdef, p, x_b, mb_b, dy, first=bkind == 0, last=bkind == 2,
                                              valid=valid, gather_free=gather_free, unroll=plan.unroll)
                return y, g, dx, l
            return run

        branches = [branch(*c) for c in combos]

        def tick(carry, row):
            stash, recv_x, recv_dx, grads, loss = carry
            f, b, arrived, slot, fs, bs, w, bc = (t[s] for t in row)
            # An arriving activation stays in its slot until its backward.
            stash = jax.lax.dynamic_update_index_in_dim(
                stash, jnp.where(arrived >= 0, recv_x, stash[slot]), slot, 0)
            # One switch runs the tick's forward and backward: the collectives inside
            # (fsdp/tensor) then follow one program order on every device. With two
            # switches the CPU runtime may start either first and deadlock.
            y, g, dx, l = jax.lax.switch(w, branches, stash[fs], pick(f), stash[bs], pick(b), recv_dx)
            if V == 1:
                grads = jax.tree.map(jnp.add, grads, g)
            else:  # add chunk bc's layer gradients into its rows only
                grads = jax.tree.map(lambda rows, acc, x: _add_rows(acc, x, bc * C) if rows else acc + x,
                                     is_rows, grads, g)
            recv_x = jax.lax.ppermute(y, AXIS, to_next)
            recv_dx = jax.lax.ppermute(dx, AXIS, to_prev)
            return (stash, recv_x, recv_dx, grads, loss + l), None

        stash = jnp.zeros((K, *zeros_act.shape), zeros_act.dtype)
        init = (stash, zeros_act, zeros_act, jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
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
    """Forward only, in the training schedule's forward order (micro-batch m on stage s
    at tick m+s without interleaving); the last virtual stage adds up the loss. Every
    input is used in the tick after it is sent: no stash."""
    S, V = plan.stages, plan.layout.virtual
    table, chunks = forward_only(S, plan.microbatches, V)
    kinds = _kinds(chunks, S, V)
    combos, work = np.unique(np.stack([kinds, chunks], -1).reshape(-1, 2), axis=0, return_inverse=True)
    tables = (jnp.asarray(table), jnp.asarray(work.reshape(table.shape).astype(np.int32)))
    gather_free = _gather_free(mesh)
    to_next, _ = _ring(S, V)

    def body(params, micro):
        s, chunk, pick, zeros_act = _stage_setup(graphdef, plan, params, micro)
        zero = (zeros_act, jnp.zeros((), jnp.float32))

        def run(kind, v):
            def branch(x, mb):
                if v < 0:
                    return zero
                p, valid = chunk(v)
                out = stage_forward(graphdef, p, x, mb, first=kind == 0, last=kind == 2, valid=valid,
                                    gather_free=gather_free, unroll=plan.unroll)
                return (zero[0], out) if kind == 2 else (out, zero[1])
            return branch

        branches = [run(int(k), int(v)) for k, v in combos]

        def tick(carry, row):
            x, loss = carry
            m, w = (t[s] for t in row)
            y, l = jax.lax.switch(w, branches, x, pick(m))
            return (jax.lax.ppermute(y, AXIS, to_next), loss + l), None

        (_, loss), _ = jax.lax.scan(tick, zero, tables)
        return jax.lax.psum(loss, AXIS)

    def eval_step(params, batch):
        loss = _run_stages(body, mesh, rules, plan, params, batch, P())
        return {"loss_sum": loss, "tokens": jnp.sum(batch["loss_mask"].astype(jnp.float32))}

    return eval_step
