"""Data placement: every island holds the whole model and trains on its share of the
global batch. It reduces its gradients with its own collectives (XLA, inside its
step program), then islands exchange them through the transfer primitive and add
them in island order. Sums of token losses add up to the whole batch's, so
dividing by the total token count weights each island by its share exactly, and
every island applies the same update to bitwise-identical parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import optim, pipeline, program, step
from hetjax.repro import digest
from hetjax import state as state_lib
from hetjax.compile import aot
from hetjax.hetero import island as island_lib
from hetjax.hetero.update import add_in_order, make_apply, sum_of_squares
from hetjax.errors import IslandsDiverged  # noqa: F401 - raised here, caught by callers


class DataShare:
    """Island k's replica: its gradient and eval programs, and one step."""

    def __init__(self, island: island_lib.Island, links):
        self.island, self.links = island, links
        isl = island
        replicated = isl.replicated()
        params_sh = isl.shardings.params
        if isl.plan is None:
            grad_fn = step.make_grad_fn(isl.graphdef, isl.mesh, isl.rules, isl.cfg.optim.grad_accum_steps,
                                        isl.cfg.sharding.grad_sync)
        else:
            grad_fn = pipeline.spmd.make_grad_fn(isl.graphdef, isl.mesh, isl.rules, isl.plan)
        P, B = aot.abstract(isl.abstract.params, params_sh), isl.abstract_batch()
        self.grads = isl.compile(grad_fn, P, B, out_shardings=(replicated, replicated, params_sh))
        self.eval = isl.compile(program.eval_step_fn(isl.icfg, isl.graphdef, isl.mesh, isl.plan), P, B,
                                out_shardings=replicated)
        self.add = isl.compile(add_in_order, [P] * isl.count, out_shardings=params_sh)
        scalar, first = isl.like((), jnp.float32), isl.first

        def totals(loss, count, grads, stop):
            """This island's share of the job's totals as one f32[4]; the squared norm is
            island 0's for all (another island's reduction order could round differently).
            One program: stacked eagerly, they took about 0.8 ms of dispatch a step."""
            sumsq = sum_of_squares(grads) if first else jnp.zeros((), jnp.float32)
            return jnp.stack([loss, count, sumsq, stop])
        self.totals = isl.compile(totals, scalar, scalar, P, scalar, out_shardings=replicated, name="totals")
        self.stop_flags = [isl.put(np.float32(flag)) for flag in (0, 1)]
        self.apply = isl.compile(make_apply(isl.cfg, isl.tx), aot.abstract(isl.abstract, isl.shardings), P,
                                 isl.like((3,), jnp.float32), donate_argnums=0,
                                 out_shardings=(isl.shardings, replicated), name="apply")
        self.like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                 isl.abstract.params, params_sh)
        self.layouts = [island_lib.remote_layouts(isl.cfg, j, param_specs(isl.cfg, j))
                        for j in range(isl.count)]

    def train_step(self, state, batch, what: str, stop: bool):
        """One step; returns (state, metrics, every island's stop flag)."""
        isl = self.island
        loss, count, grads = self.grads(state.params, batch)
        parts = self.links.all_to_all(grads, f"{what}/grads", lambda j: self.layouts[j],
                                      lambda j: self.layouts[j], self.like)
        grads = self.add(parts)
        mine = self.totals(loss, count, grads, self.stop_flags[bool(stop)])
        totals, table = self.links.totals(mine, f"{what}/totals", isl.mesh)
        state, metrics = self.apply(state, grads, isl.put(totals[:3].astype(np.float32)))
        return state, metrics, table[:, 3]

    def eval_sums(self, params, batch, what: str) -> np.ndarray:
        out = self.eval(params, batch)
        mine = jnp.stack([out["loss_sum"], out["tokens"]]).astype(jnp.float32)
        return self.links.totals(mine, f"{what}/totals", self.island.mesh)[0]

    def check_identical(self, params, what: str):
        """Starts comparing exact, layout-independent hashes of every parameter across
        islands; returns the comparison's end, which raises IslandsDiverged naming the
        first leaf and islands that differ."""
        isl = self.island
        hashes = digest.leaf_checksums(params)
        names = sorted(hashes)
        words = np.array([[int(hashes[k][:8], 16), int(hashes[k][8:], 16)] for k in names], np.uint32)
        table = self.links.start_gather(words, what, isl.mesh)  # -> (islands, tensors, 2)
        return lambda: self._compare(table(), names, what)

    def _compare(self, got, names, what: str) -> None:
        isl = self.island
        for j in range(isl.count):
            bad = np.nonzero((got[j] != got[0]).any(-1))[0]
            if len(bad):
                spec = isl.cfg.hetero.islands
                raise IslandsDiverged(
                    f"{what}: island {spec[j].name} holds different parameters than island {spec[0].name} "
                    f"({len(bad)} of {len(names)} tensors differ, first {names[bad[0]]}); the islands' "
                    f"updates are not bitwise identical on these platforms, so stop rather than train "
                    f"diverging replicas")


def param_specs(cfg, k: int):
    """Island k's PartitionSpecs of the model's parameters, from the config alone."""
    mesh = island_lib.geometry(cfg, k).abstract_mesh()
    icfg = island_lib.island_config(cfg, k)
    plan = pipeline.make_plan(icfg, mesh)
    rules = program.rules(icfg, plan)
    _, abstract = program.abstract_state(icfg, optim.make_optimizer(icfg.optim, cfg.steps), plan)
    shardings = state_lib.state_shardings(abstract, mesh, rules).params
    return island_lib.specs(shardings)
