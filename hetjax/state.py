"""The train state pytree, created abstractly, then materialised already sharded."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from hetjax import sharding
from hetjax.models.llama import ModelConfig
from hetjax.models.llama import Decoder


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # fp32 master weights, with logical axis metadata
    opt_state: Any


def make_model(cfg: ModelConfig, seed: int) -> Decoder:
    return Decoder(cfg, rngs=nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), 0)))


def abstract_state(cfg: ModelConfig, seed: int, tx: optax.GradientTransformation):
    """(graphdef, TrainState of ShapeDtypeStructs) without allocating anything."""
    model = nnx.eval_shape(lambda: make_model(cfg, seed))
    graphdef, params = nnx.split(model)
    state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
                       opt_state=jax.eval_shape(tx.init, params))
    return graphdef, state


def state_shardings(state: TrainState, mesh: Mesh, rules) -> TrainState:
    """Parameters and every parameter-shaped optimizer slot follow the rules table;
    scalars (step, Adam's count) are replicated."""
    return sharding.state_shardings(state, mesh, rules)


def create_state(cfg: ModelConfig, seed: int, tx, shardings: TrainState) -> TrainState:
    """Initialises under jit with out_shardings: no parameter is ever whole on one device."""
    def init():
        _, params = nnx.split(make_model(cfg, seed))
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    return jax.jit(init, out_shardings=shardings)()
