"""hetjax's train step against a minimal hand-written jax + optax step, in one run.

    python -m bench.step_overhead [--config configs/tiny.py] [--steps N] [--warmup W]
                                  [--repeats R] [--config.KEY=VALUE ...]

Both sides train the same model (the same NNX Decoder, graphdef and initial
parameters) with the same optax chain (hetjax.optim.make_optimizer) on the same
mesh, with the same state and batch shardings and the state donated:

- hetjax: the real path of hetjax/train.py: abstract state, state shardings,
  step.make_train_step + step.jit_train_step compiled by aot.compile; each step
  makes its batch with data.global_batch (data generation is part of hetjax's
  cost) and reads the previous step's metrics to the host, as the loop does.
- baseline: plain jax.value_and_grad of the masked mean token cross-entropy of
  nnx.merge(graphdef, params), tx.update, optax.apply_updates, under a plain
  jax.jit with the same in/out shardings and donation; no logical-axis
  constraints (no hetjax.sharding.logical_rules). Its batches are the same
  ones, generated and placed on the devices beforehand, so it pays no data cost.

Both start from identical states (two separate copies: donation consumes
buffers) and see the same batch at every step. After W warmup steps each, R
repeats of (hetjax N steps, baseline N steps) alternate; each side's figure is
the median tokens/s of its repeats. The losses of the two sides are compared
step by step (a warning is printed past 1e-4 relative), so the timing compares
the same computation. The last line printed is the tokens/s ratio.

Without --config the tiny config runs at a larger shape (DEFAULT_OVERRIDES) so
that a step is more than dispatch; `--config configs/tiny.py` runs it as is.
--config.steps is set to W + R*N (the learning-rate schedule's length).
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
from hetjax import data, optim, sharding, step
from hetjax import state as state_lib
from hetjax.compile import aot
from hetjax.mesh import describe, make_mesh

DEFAULT_CONFIG = "configs/tiny.py"
# Applied only when no --config is given: tiny, widened so that the step's compute
# is not negligible next to per-step host work, yet a run stays near a minute on
# a 2-core CPU.
DEFAULT_OVERRIDES = {
    "model.num_layers": "4",
    "model.embed_dim": "128",
    "model.mlp_dim": "384",
    "model.num_heads": "8",
    "model.num_kv_heads": "4",
    "batch_size": "32",
    "seq_len": "128",
}
BENCH_FLAGS = {"--steps": 20, "--warmup": 5, "--repeats": 5}
RTOL = 1e-4


def parse_args(argv: list[str]) -> tuple[config_lib.Config, dict[str, int]]:
    """Our --steps/--warmup/--repeats, then hetjax's --config parsing for the rest."""
    counts, rest = dict(BENCH_FLAGS), []
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        if key in counts:
            if not eq:
                if not args:
                    raise config_lib.ConfigError(f"{arg}: give a value, e.g. {arg}=10")
                value = args.pop(0)
            try:
                counts[key] = int(value)
            except ValueError:
                raise config_lib.ConfigError(f"{key}={value!r}: expected an integer") from None
            if counts[key] < (0 if key == "--warmup" else 1):
                raise config_lib.ConfigError(f"{key}={value}: too small")
        else:
            rest.append(arg)
    has_config = any(a == "--config" or a.startswith("--config=") for a in rest)
    cmd = config_lib.parse_command_line(rest if has_config else ["--config", DEFAULT_CONFIG] + rest,
                                        flags=())
    overrides = cmd.overrides if has_config else {**DEFAULT_OVERRIDES, **cmd.overrides}
    cfg = config_lib.load(cmd.config, overrides)
    counts = {k.removeprefix("--"): v for k, v in counts.items()}
    total = counts["warmup"] + counts["repeats"] * counts["steps"]
    cfg = dataclasses.replace(cfg, steps=total)
    config_lib.validate(cfg)
    return cfg, counts


# ---------------------------------------------------------------------------
# hetjax: what hetjax/train.py does before and inside its loop.


class Hetjax:
    def __init__(self, cfg: config_lib.Config, mesh):
        self.cfg = cfg
        rules = cfg.sharding.rules
        schedule = optim.learning_rate_schedule(cfg.optim, cfg.steps)
        self.tx = optim.make_optimizer(cfg.optim, cfg.steps)
        sharding.check_divisible(cfg.model.dims(), rules, mesh)
        self.graphdef, abstract_state = state_lib.abstract_state(cfg.model, cfg.seed, self.tx)
        self.state_shardings = state_lib.state_shardings(abstract_state, mesh, rules)
        self.batch_shardings = step.batch_shardings(mesh, rules)
        abstract_batch = {k: jax.ShapeDtypeStruct((cfg.batch_size, cfg.seq_len), jnp.int32, sharding=s)
                          for k, s in self.batch_shardings.items()}
        t0 = time.perf_counter()
        self.train_step = aot.compile(
            step.jit_train_step(
                step.make_train_step(self.graphdef, self.tx, schedule, mesh, rules,
                                     cfg.optim.grad_accum_steps),
                self.state_shardings, self.batch_shardings, mesh),
            aot.abstract(abstract_state, self.state_shardings), abstract_batch)
        self.compile_s = time.perf_counter() - t0
        self.num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_state.params))
        self.stream = data.SyntheticStream(cfg.model.vocab_size, cfg.seq_len, seed=cfg.data.seed,
                                           branching=cfg.data.branching,
                                           mean_doc_length=cfg.data.mean_doc_length)
        self.state = self.create_state()

    def create_state(self) -> state_lib.TrainState:
        return state_lib.create_state(self.cfg.model, self.cfg.seed, self.tx, self.state_shardings)

    def batch(self, s: int) -> dict[str, jax.Array]:
        return data.global_batch(self.stream, s, self.cfg.batch_size, self.batch_shardings)

    def run(self, first: int, n: int) -> tuple[float, list[float]]:
        """Steps first..first+n-1 as the loop runs them: (seconds, losses)."""
        losses = []

        def report(step_metrics):
            values = jax.device_get(step_metrics)
            if not np.isfinite(values["loss"]):
                raise FloatingPointError(f"hetjax loss is {values['loss']}")
            losses.append(float(values["loss"]))

        t0 = time.perf_counter()
        previous = None
        for s in range(first, first + n):
            batch = self.batch(s)
            self.state, step_metrics = self.train_step(self.state, batch)
            if previous is not None:  # one step late, as in train.py
                report(previous)
            previous = step_metrics
        report(previous)
        return time.perf_counter() - t0, losses


# ---------------------------------------------------------------------------
# baseline: a minimal hand-written step of the same model.


class Baseline:
    def __init__(self, het: Hetjax, mesh, batches: list[dict[str, jax.Array]]):
        graphdef, tx = het.graphdef, het.tx

        def loss_fn(params, batch):
            logits = nnx.merge(graphdef, params)(batch["inputs"], batch["positions"],
                                                 batch["segment_ids"])
            token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
            mask = batch["loss_mask"].astype(jnp.float32)
            return jnp.sum(token_loss * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        def train_step(params, opt_state, batch):
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
        self.train_step = jitted.lower(self.params, self.opt_state, batches[0]).compile()
        self.batches = batches

    def run(self, first: int, n: int) -> tuple[float, list[float]]:
        losses = []
        t0 = time.perf_counter()
        for s in range(first, first + n):
            self.params, self.opt_state, loss = self.train_step(self.params, self.opt_state,
                                                                self.batches[s])
            losses.append(loss)
        jax.block_until_ready((self.params, self.opt_state, losses))
        seconds = time.perf_counter() - t0
        return seconds, [float(x) for x in jax.device_get(losses)]


# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    cfg, counts = parse_args(sys.argv[1:] if argv is None else argv)
    n, warmup, repeats = counts["steps"], counts["warmup"], counts["repeats"]
    mesh = make_mesh(cfg.mesh)
    het = Hetjax(cfg, mesh)
    # The baseline's batches: the very same ones, made and placed before timing.
    batches = [het.batch(s) for s in range(cfg.steps)]
    jax.block_until_ready(batches)
    base = Baseline(het, mesh, batches)
    devices = mesh.devices.flat
    print(f"{cfg.name}: {het.num_params:,} parameters, batch {cfg.batch_size} x {cfg.seq_len}, "
          f"mesh {describe(mesh)} over {mesh.size} {devices[0].platform} device(s) "
          f"({devices[0].device_kind}); {warmup} warmup, {repeats} x {n} steps each", flush=True)

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


def cli() -> int:
    try:
        return main()
    except config_lib.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
