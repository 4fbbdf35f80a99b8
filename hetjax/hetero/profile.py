"""auto_split's short profiling run: how long one layer takes on an island."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from hetjax import sharding
from hetjax import state as state_lib
from hetjax.hetero.island import ACTIVATION


def seconds_per_layer(cfg, mesh, repeats: int = 3) -> float:
    """Best time of a forward and backward of one decoder layer on a micro-batch,
    on `mesh` (the island's devices), after a warm-up call."""
    model_cfg = dataclasses.replace(cfg.model, num_layers=1)
    rules = cfg.sharding.rules
    graphdef, abstract = state_lib.abstract_state(model_cfg, cfg.seed, optax.identity())
    shardings = state_lib.state_shardings(abstract, mesh, rules)
    state = state_lib.create_state(model_cfg, cfg.seed, optax.identity(), shardings)
    rows = cfg.batch_size // max(cfg.pipeline.microbatches, 1)
    act = NamedSharding(mesh, sharding.spec_for(ACTIVATION, rules))
    x = jax.device_put(jnp.ones((rows, cfg.seq_len, cfg.model.embed_dim), jnp.dtype(cfg.model.dtype)), act)
    positions = jnp.broadcast_to(jnp.arange(cfg.seq_len), (rows, cfg.seq_len))
    segments = jnp.ones((rows, cfg.seq_len), jnp.int32)

    @jax.jit
    def layer(params, x):
        def f(p, x):
            with sharding.logical_rules(mesh, rules):
                return jnp.sum(nnx.merge(graphdef, p).apply_layers(x, positions, segments))
        return jax.grad(f, argnums=(0, 1))(params, x)

    jax.block_until_ready(layer(state.params, x))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(layer(state.params, x))
        best = min(best, time.perf_counter() - t)
    return best
