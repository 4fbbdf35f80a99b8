"""Pipeline placement: each island is one stage and runs its own operations of the
schedule (hetjax.pipeline.schedule, `Schedule.ops`), in order, without lockstep
ticks. Activations go forward and their gradients backward through the transfer
primitive. Receives are posted when the step starts and sends return at once, so
the links work while the island computes; an island waits only for the input its
next operation needs. Each island compiles only its own stage programs.

Interleaved stages (config.pipeline.virtual_stages = V > 1): island k holds chunks
v*n + k (hetjax.hetero.island.chunks_of) and runs each as virtual stage j = v*n + k:
its input comes from virtual stage j-1 (the last island's chunk v-1 for island 0) and
its output gradient from j+1. Each chunk has its own forward and backward programs.

A chunk that is not the last virtual stage keeps its forward's residuals for its
backward (config.pipeline.recompute=False, the default): on islands the first one's
backward otherwise runs its forward again while the last one's runs it once, fused with
the loss, and the island that recomputes sets the pace.

With config.pipeline.split_backward a backward runs as two programs: B, the input gradient
(sent back at once), and W, the weight gradient, which the island's order (schedule.
split_orders) places where it would otherwise wait; B returns what W reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import sharding
from hetjax.compile import aot
from hetjax.hetero import island as island_lib
from hetjax.hetero.update import add_in_order, make_apply, sum_of_squares
from hetjax.pipeline.config import virtual_stages
from hetjax.pipeline.schedule import forward_only, make_schedule, op_label, split_orders
from hetjax.pipeline.split import Split
from hetjax.pipeline.stages import (Residuals, add_chunk, chunk_of, stage_backward, stage_backward_kept,
                                    stage_forward, stage_forward_keeping)
from hetjax.step import split_micro


class PipelineStage:
    """Island k's stage: its programs, and one training or eval step of the schedule."""

    def __init__(self, island: island_lib.Island, links):
        self.island, self.links = island, links
        cfg, k, n = island.cfg, island.index, island.count
        self.M, V = cfg.pipeline.microbatches, virtual_stages(cfg, n)
        self.V, self.J = V, n * V  # chunks per island, virtual stages
        schedule = make_schedule(cfg.pipeline.schedule, n, self.M, V)
        self.split = cfg.pipeline.split_backward
        self.ops = split_orders(schedule)[k] if self.split else schedule.ops(k)
        table, chunks = forward_only(n, self.M, V)
        self.eval_ops = [("F", int(m), int(v)) for m, v in zip(table[:, k], chunks[:, k]) if m >= 0]
        self.tied = cfg.model.tie_embeddings
        mesh, rules, graphdef = island.mesh, island.rules, island.graphdef
        act = island.activation_sharding()
        params_sh = island.shardings.params
        replicated = island.replicated()
        dtype = jnp.dtype(cfg.model.dtype)
        self.act_like = jax.ShapeDtypeStruct((cfg.batch_size // self.M, cfg.seq_len, cfg.model.embed_dim),
                                             dtype, sharding=act)
        spec = sharding.spec_for(island_lib.ACTIVATION, rules)
        self.act_layout = {j: island_lib.geometry(cfg, j).layout(spec)
                           for j in range(n)}
        size = island.chunks[0][1] - island.chunks[0][0]  # layers per chunk

        def pick(batch, m):
            with sharding.logical_rules(mesh, rules):
                return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(
                    split_micro(x, self.M), m, keepdims=False), batch)

        def programs(v: int):
            """Chunk v's forward and backward (the island's only ones when V = 1)."""
            first, last = self.virtual(v) == 0, self.virtual(v) == self.J - 1

            def mine(params):
                return params if V == 1 else chunk_of(params, v, size)

            def accumulate(acc, g):  # with V > 1, into the rows of this chunk's layers only
                return jax.tree.map(jnp.add, acc, g) if V == 1 else add_chunk(acc, g, v, size)

            def fwd(params, batch, m, x):
                with sharding.logical_rules(mesh, rules):
                    return stage_forward(graphdef, mine(params), x, pick(batch, m), first=first, last=last)

            def bwd(params, acc, loss, batch, m, x, dy):
                with sharding.logical_rules(mesh, rules):
                    g, dx, l = stage_backward(graphdef, mine(params), x, pick(batch, m), dy, first=first, last=last)
                return accumulate(acc, g), (None if first else dx), loss + l

            # Every program is compiled here, for abstract inputs: (parameters, batch,
            # micro-batch index, stage input[, its output gradient]).
            x_like, dy_like = (None if first else self.act_like), (None if last else self.act_like)
            suffix = "" if V == 1 else str(v)
            if self.split:
                return split_programs(v, first, last, mine, accumulate, fwd, x_like, dy_like, suffix)
            if not self.keeps[v]:
                return (island.compile(fwd, P, B, index, x_like, out_shardings=replicated if last else act,
                                       name=f"fwd{suffix}"),
                        island.compile(bwd, P, P, scalar, B, index, x_like, dy_like, donate_argnums=(1, 2),
                                       out_shardings=(params_sh, None if first else act, replicated),
                                       name=f"bwd{suffix}"), None)
            residuals = Residuals()

            def fwd_keeping(params, batch, m, x):
                with sharding.logical_rules(mesh, rules):
                    return stage_forward_keeping(graphdef, mine(params), x, pick(batch, m), residuals, first=first)

            def bwd_kept(params, acc, kept, x, dy):
                with sharding.logical_rules(mesh, rules):
                    g, dx = stage_backward_kept(mine(params), x, kept, dy, residuals)
                return accumulate(acc, g), (None if first else dx)

            # The residuals' shardings are the compiler's choice; the backward takes them so.
            forward = island.compiled(fwd_keeping, P, B, index, x_like, out_shardings=(act, None))
            kept_like = forward.out_info[1]
            return (island.program(forward, f"fwd{suffix}"),
                    # Only the accumulator is donated: no output has a residual's shape.
                    island.compile(bwd_kept, P, P, kept_like, x_like, dy_like, donate_argnums=1,
                                   out_shardings=(params_sh, None if first else act), name=f"bwd{suffix}"), None)

        def split_programs(v, first, last, mine, accumulate, fwd_plain, x_like, dy_like, suffix):
            """Chunk v's forward, input-gradient (B) and weight-gradient (W) programs
            (config.pipeline.split_backward). B returns what W reads: each mixing equation's
            activation inputs and output gradients (hetjax.pipeline.split)."""
            made = []

            def split(params, x, micro):  # built in the first program traced, then reused
                if not made:
                    made.append(Split(lambda p, x, b: stage_forward(graphdef, p, x, b, first=first, last=last),
                                      params, x, micro))
                return made[0]

            def split_forward(params, batch, m, x):
                p, micro = mine(params), pick(batch, m)
                return split(p, x, micro).forward(p, x, micro)

            def fwd_keeping(params, batch, m, x):  # the residuals of B and the inputs of W
                with sharding.logical_rules(mesh, rules):
                    y, vjp, acts = split_forward(params, batch, m, x)
                    return y, residuals.split(vjp, (mine(params), x)), acts

            def bwd_kept(params, kept, x, dy):
                with sharding.logical_rules(mesh, rules):
                    return Split.input_grads(residuals.join(kept, (mine(params), x)), dy)

            def bwd_again(params, loss, batch, m, x, dy):  # the forward again: recompute, or the last stage
                with sharding.logical_rules(mesh, rules):
                    y, vjp, acts = split_forward(params, batch, m, x)
                    dx, dys = Split.input_grads(vjp, jnp.ones_like(y) if last else dy)
                    return (None if first else dx), acts, dys, (loss + y if last else loss)

            def wgt(params, acc, acts, dys):
                with sharding.logical_rules(mesh, rules):
                    return accumulate(acc, made[0].weight_grads(mine(params), acts, dys))

            residuals = Residuals()
            if self.keeps[v]:
                forward = island.compiled(fwd_keeping, P, B, index, x_like, out_shardings=(act, None, None))
                kept_like, acts_like = forward.out_info[1:]
                backward = island.compiled(bwd_kept, P, kept_like, x_like, dy_like,
                                           out_shardings=(None if first else act, None))
                dys_like = backward.out_info[1]
                forward = island.program(forward, f"fwd{suffix}")
            else:
                forward = island.compile(fwd_plain, P, B, index, x_like, out_shardings=replicated if last else act,
                                         name=f"fwd{suffix}")
                backward = island.compiled(bwd_again, P, scalar, B, index, x_like, dy_like, donate_argnums=1,
                                           out_shardings=(None if first else act, None, None, replicated))
                acts_like, dys_like = backward.out_info[1:3]
            weight = island.compile(wgt, P, P, acts_like, dys_like, donate_argnums=1, out_shardings=params_sh,
                                    name=f"wgt{suffix}")
            return forward, island.program(backward, f"bwd{suffix}"), weight

        P = aot.abstract(island.abstract.params, params_sh)
        B, index, scalar = island.abstract_batch(), island.like((), jnp.int32), island.like((), jnp.float32)
        self.index = [island.put(np.int32(m)) for m in range(self.M)]
        # Which chunks' forwards return (activation, residuals) and backwards take them.
        self.keeps = [not cfg.pipeline.recompute and self.virtual(v) < self.J - 1 for v in range(V)]
        self.fwd, self.bwd, self.wgt = zip(*[programs(v) for v in range(V)])
        self.zeros = island.compile(lambda p: (jax.tree.map(jnp.zeros_like, p), jnp.zeros((), jnp.float32)),
                                    P, out_shardings=(params_sh, replicated), name="zeros")
        self.count = island.compile(lambda b: jnp.sum(b["loss_mask"].astype(jnp.float32)), B,
                                    out_shardings=replicated, name="count")
        mask, last = island_lib.owned(island.abstract.params, k, n, self.tied), island.last

        def totals(grads, loss, batch, stop):
            """What this island adds to the job's totals, as one f32[4] (the loss and token
            count are the last island's; the squared norm is over the leaves it owns). One
            program: stacked eagerly, the four took 0.8 ms of dispatch a step."""
            if not last:
                loss = count = jnp.zeros((), jnp.float32)
            else:
                count = jnp.sum(batch["loss_mask"].astype(jnp.float32))
            return jnp.stack([loss, count, sum_of_squares(grads, mask), stop])
        self.totals = island.compile(totals, P, scalar, B, scalar, out_shardings=replicated, name="totals")
        self.stop_flags = [island.put(np.float32(flag)) for flag in (0, 1)]
        self.apply = island.compile(make_apply(cfg, island.tx), aot.abstract(island.abstract, island.shardings),
                                    P, island.like((3,), jnp.float32), donate_argnums=0,
                                    out_shardings=(island.shardings, replicated), name="apply")
        self.shared = [name for name in island_lib.shared(island.abstract.params, n, self.tied)
                       if k in island_lib.holders(name, n, self.tied)]
        self._add = island.program(jax.jit(add_in_order), "add_shared")  # only for shared leaves, rarely

    # -- one pass of the schedule -------------------------------------------------

    def virtual(self, v: int) -> int:
        """The virtual stage that this island's chunk v is."""
        return v * self.island.count + self.island.index

    def _peer(self, j: int) -> int:
        """The island that holds virtual stage j."""
        return j % self.island.count

    def _tag(self, what: str, kind: str, m: int, j: int) -> str:
        """The message carrying micro-batch m's `kind` (x or dy) to virtual stage j."""
        return f"{what}/{kind}{m}" + ("" if self.V == 1 else f".{j}")

    def _run(self, params, batch, what: str, ops, train: bool):
        links, J, layout = self.links, self.J, self.act_layout
        recv_x = {(m, v): links.recv(self._peer(j - 1), self._tag(what, "x", m, j), self.act_like,
                                     layout[self._peer(j - 1)])
                  for op, m, v in ops if op == "F" and (j := self.virtual(v)) > 0}
        recv_dy = {(m, v): links.recv(self._peer(j + 1), self._tag(what, "dy", m, j), self.act_like,
                                      layout[self._peer(j + 1)])
                   for op, m, v in ops if op == "B" and (j := self.virtual(v)) < J - 1}
        acc, loss = self.zeros(params) if train else (None, jnp.zeros((), jnp.float32))
        stash, sends = {}, []
        weight_inputs = {}  # (m, v) -> what a split backward's W reads
        for op, m, v in ops:
            mm, j = self.index[m], self.virtual(v)
            label = op_label(op, m, v, self.V)
            if op == "W":
                acc = self.wgt[v](params, acc, *weight_inputs.pop((m, v)), label=label)
                continue
            if op == "F":
                x = links.wait(recv_x.pop((m, v)), self._peer(j - 1)) if j > 0 else None
                if j == J - 1 and train:
                    stash[m, v] = x
                    continue  # the last stage's backward computes its forward and the loss
                y = self.fwd[v](params, batch, mm, x, label=label)
                if self.keeps[v]:
                    y, *kept = y  # an eval, which has no backward, drops them at its next operation
                if train:  # what the backward reads: the residuals and input, or the input alone
                    stash[m, v] = (kept[0], x, *kept[1:]) if self.keeps[v] else x
                if j == J - 1:
                    loss = loss + y
                else:
                    nxt = self._peer(j + 1)
                    sends.append((nxt, links.send(nxt, y, self._tag(what, "x", m, j + 1), layout[nxt])))
            else:
                dy = None if j == J - 1 else links.wait(recv_dy.pop((m, v)), self._peer(j + 1))
                if self.split and self.keeps[v]:  # B alone; W (below) runs later
                    kept, x, acts = stash.pop((m, v))
                    dx, dys = self.bwd[v](params, kept, x, dy, label=label)
                    weight_inputs[m, v] = acts, dys
                elif self.split:
                    dx, acts, dys, loss = self.bwd[v](params, loss, batch, mm, stash.pop((m, v)), dy, label=label)
                    weight_inputs[m, v] = acts, dys
                elif self.keeps[v]:
                    acc, dx = self.bwd[v](params, acc, *stash.pop((m, v)), dy, label=label)
                else:
                    acc, dx, loss = self.bwd[v](params, acc, loss, batch, mm, stash.pop((m, v)), dy, label=label)
                if j > 0:
                    prev = self._peer(j - 1)
                    sends.append((prev, links.send(prev, dx, self._tag(what, "dy", m, j - 1), layout[prev])))
        for i, h in sends:
            links.wait(h, i, sent=True)
        return acc, loss

    def train_step(self, state, batch, what: str, stop: bool):
        """One step; returns (state, metrics, every island's stop flag)."""
        isl = self.island
        grads, loss = self._run(state.params, batch, what, self.ops, train=True)
        if self.shared:
            grads = self._add_shared(grads, what)
        # Every island needs the same totals: the loss is the last island's, the squared
        # norm a sum over islands of the leaves each one owns.
        mine = self.totals(grads, loss, batch, self.stop_flags[bool(stop)])
        totals, table = self.links.totals(mine, f"{what}/totals", isl.mesh)
        state, metrics = self.apply(state, grads, isl.put(totals[:3].astype(np.float32)))
        return state, metrics, table[:, 3]

    def _add_shared(self, grads, what: str):
        """A leaf that several islands hold (a tied embedding): every holder adds all
        holders' gradients in island order, so all keep identical copies."""
        isl, n, flatten = self.island, self.island.count, jax.tree_util.tree_flatten_with_path
        keys = [jax.tree_util.keystr(p) for p, _ in flatten(grads)[0]]
        is_shared = [island_lib.top_name(p) in self.shared for p, _ in flatten(grads)[0]]
        leaves, treedef = jax.tree.flatten(grads)
        shards = jax.tree.leaves(isl.shardings.params)
        mine = {key: x for key, x, keep in zip(keys, leaves, is_shared) if keep}
        shard = {key: s for key, s, keep in zip(keys, shards, is_shared) if keep}
        like = {key: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard[key]) for key, x in mine.items()}
        specs = island_lib.specs(shard)

        def layouts(j):
            return island_lib.remote_layouts(isl.cfg, j, specs)

        parts = self.links.all_to_all(mine, f"{what}/shared", layouts, layouts, like,
                                      among=island_lib.holders(self.shared[0], n, self.tied))
        total = self._add(parts)
        return jax.tree.unflatten(treedef, [total[key] if keep else x
                                            for key, x, keep in zip(keys, leaves, is_shared)])

    def eval_sums(self, params, batch, what: str) -> np.ndarray:
        """(loss sum, tokens) of an eval batch, the same on every island."""
        isl = self.island
        _, loss = self._run(params, batch, what, self.eval_ops, train=False)
        count = self.count(batch)
        mine = jnp.stack([jnp.asarray(loss if isl.last else 0.0, jnp.float32),
                          jnp.asarray(count if isl.last else 0.0, jnp.float32)])
        return self.links.totals(mine, f"{what}/totals", isl.mesh)[0]
