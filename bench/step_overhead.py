"""hetjax's train step against a minimal hand-written jax + optax step, in one run.

    python -m bench.step_overhead [--config configs/tiny.py] [--steps N] [--warmup W]
                                  [--repeats R] [--constrain-baseline] [--config.KEY=VALUE ...]

Both sides train the same model (the same NNX Decoder, graphdef and initial
parameters) with the same optax chain (hetjax.optim.make_optimizer) on the same
mesh, with the same state and batch shardings and the state donated:

- hetjax: the real path of hetjax/train.py: program.build (abstract state and its
  shardings) and its compiled train step; each step
  takes its batch from the grain data iterator (data loading is part of hetjax's
  cost) and reads the previous step's metrics to the host, as the loop does.
- baseline: plain jax.value_and_grad of the masked mean token cross-entropy of
  nnx.merge(graphdef, params), tx.update, optax.apply_updates, under a plain
  jax.jit with the same in/out shardings and donation; no logical-axis
  constraints (no hetjax.sharding.logical_rules). Its batches are the same
  ones, made and placed on the devices before its clock starts: it pays no
  data cost. Like hetjax's loop it keeps at most two steps in flight.
  With --constrain-baseline it is traced under hetjax.sharding.logical_rules,
  so on a multi-device mesh both compile to the same partitioning and the
  ratio isolates hetjax's per-step host work (without it, the ratio on such a
  mesh also measures what the constraints do for XLA's sharding propagation).

Both start from identical states (two separate copies: donation consumes
buffers) and see the same batch at every step. After W warmup steps each, R
repeats of (hetjax N steps, baseline N steps) alternate; each side's figure is
the median tokens/s of its repeats. Their losses after the same steps must
agree within 1e-4 relative (else a warning is printed): the timing compares
the same computation. The last line printed is the tokens/s ratio.

Without --config the tiny config runs with a doubled batch (DEFAULT_OVERRIDES),
about a minute on 2 CPU cores; `--config configs/tiny.py` runs it as is.
The learning-rate schedule's length (config.steps) is set to W + R*N.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hetjax import config as config_lib
from bench import common
from hetjax import data, program, sharding
from hetjax import state as state_lib
from hetjax.compile import cli
from hetjax.mesh import describe, make_mesh

# Applied only when no --config is given: tiny with twice its batch, so that the
# step is more than dispatch yet a run stays near a minute on a 2-core CPU.
DEFAULT_OVERRIDES = {"batch_size": "32"}
COUNTS = {"--steps": (10, 1), "--warmup": (5, 0), "--repeats": (14, 1)}  # (default, least)
RTOL = 1e-4


def parse_args(argv: list[str]) -> tuple[config_lib.Config, dict]:
    """Our --steps/--warmup/--repeats/--constrain-baseline, then hetjax's --config
    parsing for the rest. --config.steps becomes W + R*N, the schedule's length."""
    cfg, opts = common.parse(argv, COUNTS, ("--constrain-baseline",), DEFAULT_OVERRIDES, __doc__)
    cfg = dataclasses.replace(cfg, steps=opts["warmup"] + opts["repeats"] * opts["steps"])
    config_lib.validate(cfg)
    if cfg.mesh.pipeline > 1:  # the hand-written baseline is the unpipelined model
        raise config_lib.ConfigError(
            f"config.mesh.pipeline={cfg.mesh.pipeline}: this bench compares unpipelined steps; "
            f"use bench/pipeline_bubble.py for pipelines")
    return cfg, opts


# ---------------------------------------------------------------------------
# hetjax: what hetjax/train.py does before and inside its loop.


class Hetjax:
    def __init__(self, cfg: config_lib.Config, mesh):
        self.cfg = cfg
        self.prog = program.build(cfg, mesh)
        self.train_step = self.prog.compile_train_step()
        self.graphdef, self.tx = self.prog.graphdef, self.prog.tx
        self.state_shardings, self.batch_shardings = self.prog.state_shardings, self.prog.batch_shardings
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(self.prog.state.params))
        self.data = data.build(cfg)
        self.state = self.create_state()

    def create_state(self) -> state_lib.TrainState:
        return self.prog.init_state()

    def batch(self, s: int) -> dict[str, jax.Array]:
        return self.data.batch(s, self.batch_shardings)

    def run(self, first: int, n: int) -> tuple[float, list[float]]:
        """Steps first..first+n-1 as the loop runs them: (seconds, losses)."""
        losses = []

        def report(step_metrics):
            values = jax.device_get(step_metrics)
            if not np.isfinite(values["loss"]):
                raise FloatingPointError(f"hetjax loss is {values['loss']}")
            losses.append(float(values["loss"]))

        batches = self.data.iterator(self.batch_shardings, first)
        t0 = time.perf_counter()
        previous = None
        for s in range(first, first + n):
            self.state, step_metrics = self.train_step(self.state, next(batches))
            if previous is not None:  # one step late, as in train.py
                report(previous)
            previous = step_metrics
        report(previous)
        seconds = time.perf_counter() - t0
        batches.close()
        return seconds, losses


# ---------------------------------------------------------------------------
# baseline: a minimal hand-written step of the same model.


class Baseline:
    def __init__(self, het: Hetjax, mesh, constrain: bool = False):
        graphdef, tx = het.graphdef, het.tx
        rules = het.cfg.sharding.rules

        def loss_fn(params, batch):
            logits = nnx.merge(graphdef, params)(batch["inputs"], batch["positions"],
                                                 batch["segment_ids"])
            token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            mask = batch["loss_mask"].astype(jnp.float32)
            return jnp.sum(token_loss * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        def train_step(params, opt_state, batch):
            if constrain:
                with sharding.logical_rules(mesh, rules):
                    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            else:
                loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        sh = het.state_shardings
        replicated = NamedSharding(mesh, PartitionSpec())
        jitted = jax.jit(train_step, in_shardings=(sh.params, sh.opt_state, het.batch_shardings),
                         out_shardings=(sh.params, sh.opt_state, replicated),
                         donate_argnums=(0, 1))
        state = het.create_state()  # a second, identical copy
        self.params, self.opt_state = state.params, state.opt_state
        abstract_batch = program.abstract_batch(het.cfg.batch_size, het.cfg.seq_len,
                                             het.batch_shardings)
        self.train_step = jitted.lower(self.params, self.opt_state, abstract_batch).compile()
        self.het = het

    def run(self, first: int, n: int) -> tuple[float, list[float]]:
        """Steps first..first+n-1 on hetjax's very batches, made and placed on the
        devices before the clock starts: (seconds, losses)."""
        batches = jax.block_until_ready([self.het.batch(s) for s in range(first, first + n)])
        losses = []
        t0 = time.perf_counter()
        for batch in batches:
            self.params, self.opt_state, loss = self.train_step(self.params, self.opt_state, batch)
            # At most two steps in flight, as in hetjax's loop (also, deep queues of
            # collectives can deadlock XLA:CPU's virtual devices).
            if losses:
                losses[-1].block_until_ready()
            losses.append(loss)
        jax.block_until_ready((self.params, self.opt_state, losses))
        seconds = time.perf_counter() - t0
        return seconds, [float(x) for x in jax.device_get(losses)]


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    cfg, opts = parse_args(sys.argv[1:] if argv is None else argv)
    n, warmup, repeats = opts["steps"], opts["warmup"], opts["repeats"]
    mesh = make_mesh(cfg.mesh)
    het = Hetjax(cfg, mesh)
    base = Baseline(het, mesh, opts["constrain_baseline"])
    devices = mesh.devices.flat
    print(f"{cfg.name}: {het.num_params:,} parameters, batch {cfg.batch_size} x {cfg.seq_len}, "
          f"mesh {describe(mesh)} over {mesh.size} {devices[0].platform} device(s) "
          f"({devices[0].device_kind}); {warmup} warmup, {repeats} x {n} steps each; baseline "
          f"{'with' if opts['constrain_baseline'] else 'without'} logical-axis constraints",
          flush=True)

    losses = {"hetjax": [], "baseline": []}
    seconds = {"hetjax": [], "baseline": []}
    for name, runner in (("hetjax", het), ("baseline", base)):
        if warmup:
            losses[name] += runner.run(0, warmup)[1]
    for r in range(repeats):
        first = warmup + r * n
        for name, runner in (("hetjax", het), ("baseline", base)):
            t, l = runner.run(first, n)
            seconds[name].append(t)
            losses[name] += l

    tokens = n * cfg.batch_size * cfg.seq_len
    rate = {k: statistics.median(tokens / t for t in v) for k, v in seconds.items()}
    print(f"{'':>10} {'tokens/s':>12} {'step ms':>9}   (median of {repeats} x {n} steps; "
          f"min..max tokens/s)")
    for name in ("hetjax", "baseline"):
        spread = [tokens / t for t in seconds[name]]
        print(f"{name:>10} {rate[name]:12,.0f} {tokens / rate[name] / n * 1e3:9.2f}   "
              f"({min(spread):,.0f}..{max(spread):,.0f})")

    h, b = np.array(losses["hetjax"]), np.array(losses["baseline"])
    rel = np.abs(h - b) / np.maximum(np.abs(b), 1e-12)
    print(f"loss after {len(h)} steps: hetjax {h[-1]:.6f}, baseline {b[-1]:.6f} "
          f"(relative difference {rel[-1]:.1e}; largest over all steps {rel.max():.1e})")
    if rel[-1] > RTOL:
        print(f"WARNING: the losses differ by {rel[-1]:.1e} relative (> {RTOL:g}): the two "
              f"steps may not compute the same thing", flush=True)
    print(f"tokens/s ratio hetjax/baseline: {rate['hetjax'] / rate['baseline']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
