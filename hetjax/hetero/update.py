"""The optimizer step of an island, given the whole job's totals.

Every island adds up the same exchanged numbers (loss sum, token count, squared
gradient norm) in the same island order, so each applies exactly the update a
one-island run would: mean gradients, clipped by the global norm (as
optax.clip_by_global_norm does), then the island's AdamW, which is elementwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from hetjax.optim import learning_rate_schedule, updates_applied
from hetjax.state import TrainState


def add_in_order(parts):
    """parts[0] + parts[1] + ... leaf by leaf, always in this order: every island that
    adds the same parts gets the same bits."""
    return jax.tree.map(lambda *xs: sum(xs[1:], xs[0]), *parts)


def sum_of_squares(grads, mask=None) -> jax.Array:
    """Squared L2 norm over the leaves where mask is True (all by default)."""
    leaves = jax.tree.leaves(grads)
    keep = [True] * len(leaves) if mask is None else jax.tree.leaves(mask)
    return sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g, k in zip(leaves, keep) if k),
               jnp.zeros((), jnp.float32))


def make_apply(cfg, tx):
    """apply(state, summed grads, totals f32[3] = (loss sum, tokens, squared norm of the
    summed grads)) -> (state, metrics); jit it with the island's shardings."""
    clip = cfg.optim.grad_clip_norm
    schedule = learning_rate_schedule(cfg.optim, cfg.steps)

    def apply(state: TrainState, grads, totals):
        count = jnp.maximum(totals[1], 1.0)
        norm = jnp.sqrt(totals[2]) / count  # the norm of the mean gradient
        grads = jax.tree.map(lambda g: g / count, grads)
        if clip > 0:
            grads = jax.tree.map(lambda g: jax.lax.select(norm < clip, g, (g / norm) * clip), grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": totals[0] / count, "grad_norm": norm,
                   "learning_rate": schedule(updates_applied(state.opt_state)), "tokens": count}
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return apply
