"""Pure train and eval steps: (state, batch) -> (state, metrics): the loss, its gradients
and the update. Compiling them is hetjax.program's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from hetjax import optim, sharding
from hetjax.data import packing
from hetjax.state import TrainState

BATCH_AXES = ("batch", "length")
BATCH_KEYS = packing.KEYS  # what the data pipeline makes is what the step reads


def loss_sums(params, graphdef, batch):
    """(sum of token losses, number of loss tokens): callers divide, so that
    micro-batches and shards of a batch add up to the same mean."""
    model = nnx.merge(graphdef, params)
    logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])  # (B, T, V) fp32
    return loss_sums_of_logits(logits, batch)


def loss_sums_of_logits(logits, batch):
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(token_loss * mask), jnp.sum(mask)


def split_micro(x, n):
    """(B, ...) -> (n, B/n, ...): n micro-batches of a batch."""
    # Micro-batch i takes rows i, i+n, i+2n, ...: every data shard keeps an equal
    # part of each micro-batch, so no micro-batch sits on a subset of devices.
    x = x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1)
    return sharding.constrain(x, (None, *BATCH_AXES))


def make_train_step(graphdef, tx: optax.GradientTransformation, schedule, mesh: Mesh, rules,
                    grad_accum_steps: int = 1, grad_sync: str = "per_layer"):
    """The pure step. Gradients of all micro-batches are summed, then divided by
    the token count once, so accumulation changes memory, not the result."""
    grad_fn = make_grad_fn(graphdef, mesh, rules, grad_accum_steps, grad_sync)

    def train_step(state: TrainState, batch):
        loss_sum, count, grads = grad_fn(state.params, batch)
        return apply_gradients(state, tx, schedule, grads, loss_sum, count)

    return train_step


def make_grad_fn(graphdef, mesh: Mesh, rules, grad_accum_steps: int = 1, grad_sync: str = "per_layer"):
    """(params, batch) -> (loss sum, token count, summed gradients), like the pipeline's.

    grad_sync="once" (config.sharding.grad_sync): each shard of the batch over `data` sums
    its own gradients and the shards meet once, after the backward pass. Left to itself,
    XLA all-reduces each layer's gradient inside the backward layer loop: a meeting of
    every process per layer, each a wait for the slowest where collectives block
    (docs/measurements.md, bench/multiprocess_overhead.py)."""
    if grad_sync not in sharding.GRAD_SYNCS:
        raise ValueError(f"grad_sync={grad_sync!r}: use one of {sharding.GRAD_SYNCS}")
    if grad_sync == "per_layer" or mesh.shape.get("data", 1) == 1:
        return _sums(graphdef, mesh, rules, grad_accum_steps)
    assert not sharding.beside_batch_on_data(rules), rules  # validate_sharding refuses these
    n = mesh.shape["data"]
    local = _sums(graphdef, mesh, sharding.without_axis(rules, "data"), grad_accum_steps)

    def sums(params, batch):
        # (B, T) -> (data, B/data, T): no data moves, as `batch` splits over data first
        # (validate_sharding).
        shards = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
        # Each shard's sums stay on its devices (spmd_axis_name) until the one sum below.
        # (A shard_map manual over `data` would say the same, but XLA 0.10's partitioner
        # aborts on its embedding lookup when fsdp and tensor both split the table.)
        per_shard = jax.vmap(local, in_axes=(None, 0), spmd_axis_name="data")(params, shards)
        return jax.tree.map(lambda x: jnp.sum(x, axis=0), per_shard)

    return sums


def _sums(graphdef, mesh: Mesh, rules, grad_accum_steps: int):
    grad_fn = jax.value_and_grad(loss_sums, has_aux=True)

    def sums(params, batch):
        with sharding.logical_rules(mesh, rules):
            if grad_accum_steps == 1:
                (loss_sum, count), grads = grad_fn(params, graphdef, batch)
                return loss_sum, count, grads
            micro = jax.tree.map(lambda x: split_micro(x, grad_accum_steps), batch)

            def accumulate(carry, mb):
                (l, c), g = grad_fn(params, graphdef, mb)
                return jax.tree.map(jnp.add, carry, (l, c, g)), None

            zeros = (jnp.zeros(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            return jax.lax.scan(accumulate, zeros, micro)[0]

    return sums


def apply_gradients(state: TrainState, tx, schedule, grads, loss_sum, count):
    """Every train step's tail: summed gradients -> mean, optimizer update, metrics."""
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": loss_sum / count,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": schedule(optim.updates_applied(state.opt_state)),  # the rate this update took
        "tokens": count,
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def make_eval_step(graphdef, mesh: Mesh, rules, micro_batches: int = 1):
    """(params, batch) -> {"loss_sum", "tokens"}, over `micro_batches` parts of the batch
    in turn as the train step takes them, so that an eval fits where a step fits."""
    def eval_step(params, batch):
        with sharding.logical_rules(mesh, rules):
            if micro_batches == 1:
                loss_sum, count = loss_sums(params, graphdef, batch)
            else:
                def add(carry, mb):
                    return jax.tree.map(jnp.add, carry, loss_sums(params, graphdef, mb)), None

                micro = jax.tree.map(lambda x: split_micro(x, micro_batches), batch)
                loss_sum, count = jax.lax.scan(add, (jnp.zeros(()), jnp.zeros(())), micro)[0]
        return {"loss_sum": loss_sum, "tokens": count}
    return eval_step
