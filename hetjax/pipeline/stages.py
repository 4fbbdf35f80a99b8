"""A model cut into stages: the parameter layout, and one stage's forward and
backward as plain functions of (stage parameters, input, micro-batch).

The functions know nothing about meshes or schedules, so they serve both the
single-program pipeline (hetjax.pipeline.spmd) and stages that live in different
processes (islands), joined by a transfer of activations and their gradients.

Layout. The stacked layers (leading `layers` axis) are cut into S runs of
`stage_layers[s]` layers. An even split keeps the model's own layout: stage s
holds layers [s*L/S, (s+1)*L/S), so `layers -> pipeline` is an ordinary
NamedSharding and checkpoints are interchangeable with the unpipelined model.
An uneven split pads every stage to the longest one, P = max(stage_layers),
giving a leading axis of S*P that the pipeline axis divides. Padding layers are
zero and masked to the identity, so their gradients, Adam moments and weight
decay are exactly zero and they never change.

Interleaved stages (virtual = V > 1): the layers are cut into S*V equal chunks and
stage s holds chunks s, S+s, 2S+s, ... (virtual stage j = v*S + s is its chunk v),
stored as its V chunks one after the other. That layout is a permutation of the
model's, which to_stages/from_stages convert exactly both ways.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hetjax.errors import ConfigError
from hetjax.sharding import constrain
from hetjax.step import loss_sums_of_logits
from hetjax.models.llama import BLOCKS  # noqa: F401 - the stacked layers' name, re-exported for stage code


@dataclasses.dataclass(frozen=True)
class StageLayout:
    stage_layers: tuple[int, ...]  # layers of each virtual stage j = v*S + s (S*V of them)
    virtual: int = 1  # chunks per stage

    @property
    def stages(self) -> int:
        return len(self.stage_layers) // self.virtual

    @property
    def per_stage(self) -> int:
        return max(self.stage_layers)

    @property
    def padded(self) -> bool:
        return len(set(self.stage_layers)) > 1

    @property
    def reordered(self) -> bool:
        """Whether the pipeline layout differs from the model's (padding or chunks)."""
        return self.padded or self.virtual > 1

    def source(self) -> np.ndarray:
        """(S*V*P,): the model layer at each padded position, -1 for padding; stage s's
        chunk v (virtual stage v*S + s) is at positions [(s*V + v)*P, (s*V + v + 1)*P)."""
        S, V, P = self.stages, self.virtual, self.per_stage
        out = np.full((S, V, P), -1)
        start = 0
        for j, n in enumerate(self.stage_layers):
            v, s = divmod(j, S)
            out[s, v, :n] = np.arange(start, start + n)
            start += n
        return out.reshape(-1)

    def valid(self) -> np.ndarray:
        """(S, V*P) bool: which positions of each stage hold a real layer."""
        return (self.source() >= 0).reshape(self.stages, self.virtual * self.per_stage)

    def stage_range(self, stage: int) -> tuple[int, int]:
        """Model layers [start, stop) of this (virtual) stage."""
        start = sum(self.stage_layers[:stage])
        return start, start + self.stage_layers[stage]


def make_layout(num_layers: int, stages: int, stage_layers=(), virtual: int = 1) -> StageLayout:
    """Layers per stage: `stage_layers` if given, else an even split (ConfigError
    otherwise); with `virtual` chunks per stage, an even split into stages * virtual."""
    if virtual > 1:
        if stage_layers or num_layers % (stages * virtual):
            raise ConfigError(
                f"config.model.num_layers={num_layers} with config.pipeline.stage_layers={tuple(stage_layers)}: "
                f"config.pipeline.virtual_stages={virtual} needs an even split into {stages} x {virtual} "
                f"chunks (stage_layers=() and num_layers a multiple of {stages * virtual})")
        return StageLayout((num_layers // (stages * virtual),) * (stages * virtual), virtual)
    if stage_layers:
        stage_layers = tuple(stage_layers)
        if len(stage_layers) != stages:
            raise ConfigError(
                f"config.pipeline.stage_layers={stage_layers} names {len(stage_layers)} stages but "
                f"the mesh has pipeline={stages}; give one layer count per stage")
        if min(stage_layers) < 1 or sum(stage_layers) != num_layers:
            raise ConfigError(
                f"config.pipeline.stage_layers={stage_layers}: each stage needs >= 1 layer and "
                f"they must add up to config.model.num_layers={num_layers}")
        return StageLayout(stage_layers)
    if num_layers % stages:
        raise ConfigError(
            f"config.model.num_layers={num_layers} does not split evenly into {stages} pipeline "
            f"stages; set config.pipeline.stage_layers (e.g. an uneven split adding up to "
            f"{num_layers}) or change config.mesh.pipeline")
    return StageLayout((num_layers // stages,) * stages)


def _is_blocks(path) -> bool:
    key = path[0]
    return getattr(key, "key", getattr(key, "name", None)) == BLOCKS


def map_blocks(fn, tree, other=lambda x: x):
    """Applies fn to the stacked-layer leaves of a parameter tree, `other` to the rest."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(x) if _is_blocks(p) else other(x), tree)


def permute_layers(tree, index):
    """Every stacked-layer leaf of `tree` taken at `index` along its layer axis: the
    parameters' `blocks` and, in a train state, the optimizer slots that mirror them
    (their key paths hold `blocks` deeper down)."""
    def one(path, x):
        names = {getattr(k, "key", getattr(k, "name", None)) for k in path}
        return x[index] if BLOCKS in names else x
    return jax.tree_util.tree_map_with_path(one, tree)


def chunk_of(params, chunk: int, size: int):
    """The parameters with `blocks` cut to layers [chunk*size, (chunk+1)*size) of those
    held: one chunk of a stage that holds several (interleaved stages on islands)."""
    return map_blocks(lambda x: x[chunk * size:(chunk + 1) * size], params)


def add_chunk(acc, grads, chunk: int, size: int):
    """acc + grads, where grads' `blocks` are those of one chunk (see chunk_of)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a, g: a.at[chunk * size:(chunk + 1) * size].add(g) if _is_blocks(p) else a + g, acc, grads)


def to_stages(params, layout: StageLayout):
    """Model layout (L, ...) -> pipeline layout (S*V*P, ...), padding with zeros."""
    if not layout.reordered:
        return params
    src = layout.source()
    idx, keep = np.maximum(src, 0), src >= 0

    def pad(x):
        mask = keep.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(mask, x[idx], jnp.zeros((), x.dtype))
    return map_blocks(pad, params)


def from_stages(params, layout: StageLayout):
    """Pipeline layout (S*V*P, ...) -> model layout (L, ...)."""
    if not layout.reordered:
        return params
    src = layout.source()
    real = np.nonzero(src >= 0)[0]
    real = real[np.argsort(src[real])]  # model layer order
    return map_blocks(lambda x: x[real], params)


def stage_params(params, layout: StageLayout, stage: int):
    """One stage's parameters (model layout in): its layers, and the embedding
    and head leaves, which only the first and last stages use."""
    start, stop = layout.stage_range(stage)
    return map_blocks(lambda x: x[start:stop], params)


def stage_forward(graphdef, params, x, batch, *, first: bool, last: bool, valid=None,
                  gather_free: bool = False, unroll: bool = False):
    """One stage on one micro-batch.

    params: the model's parameters with `blocks` holding only this stage's layers.
    x: (b, T, D) activation from the previous stage (ignored on the first stage,
    which embeds batch["inputs"]). Returns the (b, T, D) activation, or on the last
    stage the micro-batch's summed token loss (a scalar).
    valid: (layers,) bool, False for padding layers.
    gather_free: embed and pick label logits with one-hot products instead of
    gathers (see hetjax.pipeline.spmd for why).
    unroll: the stage's layers written out instead of scanned (config.pipeline.scan_layers).
    """
    model = nnx.merge(graphdef, params)
    if first:
        x = _one_hot_embed(model, batch["inputs"]) if gather_free else model.embed(batch["inputs"])
    x = model.apply_layers(x, batch["positions"], batch["segment_ids"], valid, unroll=unroll)
    if not last:
        return x
    logits = model.logits(x)  # (b, T, V) fp32
    if gather_free:
        labels = jax.nn.one_hot(batch["targets"], logits.shape[-1], dtype=logits.dtype)
        token_loss = jax.nn.logsumexp(logits, axis=-1) - jnp.sum(labels * logits, axis=-1)
        return jnp.sum(token_loss * batch["loss_mask"].astype(jnp.float32))
    return loss_sums_of_logits(logits, batch)[0]


def _one_hot_embed(model, tokens):
    table = model.embed_VD[...]
    x = jnp.einsum("BTV,VD->BTD", jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype), table)
    return constrain(x.astype(model.dtype), ("batch", "length", "embed"))


def stage_backward(graphdef, params, x, batch, dy, *, first: bool, last: bool, valid=None,
                   gather_free: bool = False, unroll: bool = False):
    """Recomputes the stage from its input x and returns (parameter gradients,
    input gradient, loss sum). dy is the gradient of the stage's output; the last
    stage seeds its loss sum with 1 instead, and returns that loss sum (0 elsewhere)."""
    out, vjp = jax.vjp(lambda p, x: stage_forward(graphdef, p, x, batch, first=first, last=last, valid=valid,
                                                  gather_free=gather_free, unroll=unroll), params, x)
    grads, dx = vjp(jnp.ones_like(out) if last else dy)
    return grads, dx, (out if last else jnp.zeros((), jnp.float32))


class Residuals:
    """What a stage's backward reads from its forward (jax.vjp's residuals), less the
    parameters and input among them: the backward program takes those as arguments
    anyway, and a forward program that returned them would copy them. The forward's
    trace records where they sit (`split`), the backward's trace puts them back (`join`),
    so the forward must be traced first."""

    def __init__(self):
        self.treedef, self.positions, self.args = None, None, None

    def split(self, vjp, args) -> list:
        leaves, treedef = jax.tree.flatten(vjp)
        where = {id(a): k for k, a in enumerate(jax.tree.leaves(args))}
        self.treedef, self.positions = treedef, [where.get(id(leaf)) for leaf in leaves]
        self.args = jax.tree.structure(args)
        return [leaf for leaf, k in zip(leaves, self.positions) if k is None]

    def join(self, kept: list, args):
        assert self.treedef is not None, "the forward is traced before the backward"
        assert jax.tree.structure(args) == self.args and len(kept) == self.positions.count(None)
        given, rest = jax.tree.leaves(args), iter(kept)
        return jax.tree.unflatten(self.treedef, [next(rest) if k is None else given[k] for k in self.positions])


def _all_but_casts(prim, *_, **__) -> bool:
    """A remat policy: every value may be saved but a dtype cast's. With bf16 compute over
    fp32 weights the layers cast each weight: saved, the casts would keep a copy of the
    stage's weights per micro-batch in flight. The backward casts again instead."""
    return prim is not jax.lax.convert_element_type_p


def stage_forward_keeping(graphdef, params, x, batch, residuals: Residuals, *, first: bool, valid=None,
                          gather_free: bool = False, unroll: bool = False):
    """stage_forward of a stage that is not the last, and the residuals its backward
    reads (stage_backward_kept), so that the backward need not run the forward again:
    ((b, T, D) activation, residuals)."""
    def forward(p, x):
        return stage_forward(graphdef, p, x, batch, first=first, last=False, valid=valid,
                             gather_free=gather_free, unroll=unroll)

    y, vjp = jax.vjp(jax.checkpoint(forward, policy=_all_but_casts), params, x)
    return y, residuals.split(vjp, (params, x))


def stage_backward_kept(params, x, kept: list, dy, residuals: Residuals):
    """(parameter gradients, input gradient) of a stage from the residuals its forward
    kept (stage_forward_keeping) and dy, the gradient of its output."""
    return residuals.join(kept, (params, x))(dy)
