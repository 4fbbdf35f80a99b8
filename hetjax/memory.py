"""Bytes per device before anything is allocated, and a clear refusal when they do not fit."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple

import jax
import numpy as np

from hetjax import sharding
from hetjax.config import Config
from hetjax.errors import ConfigError
from hetjax.pipeline.config import virtual_stages
from hetjax.errors import DoesNotFit  # noqa: F401 - raised here, caught by callers

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per device. Activations are an analytic estimate (the compiled
    program's own figure is what `--compile_only` prints)."""

    parameters: int
    optimizer: int
    gradients: int
    activations: int
    per_layer: int  # of the four above, what one more layer adds
    devices: int
    gathered: int = 0  # weights fsdp gathers whole for their use (embedding, head, a layer)

    @property
    def total(self) -> int:
        return self.parameters + self.optimizer + self.gradients + self.activations + self.gathered

    def describe(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / GiB:.2f}"
                          for k in ("parameters", "optimizer", "gradients", "activations", "gathered")
                          if k != "gathered" or self.gathered)
        return f"{self.total / GiB:.2f} GiB per device ({parts})"


class Splits(NamedTuple):
    """How many ways config.sharding.rules split each kind of a layer's activations,
    past their batch and length (each its own: a rule edited for an experiment changes
    what each device holds of that kind only)."""

    embed: int = 1  # the residual stream, norms
    heads: int = 1  # queries, attention outputs, the attention's logits
    kv: int = 1  # keys and values
    mlp: int = 1  # SwiGLU's hidden units


def _dim_splits(logical, rules, sizes) -> list[int]:
    """How many ways each dimension of an array with these logical axes is split, by
    `rules` on a mesh of `sizes` (mesh axis -> size): a mesh axis splits the first that names it."""
    return [sharding.shards(axes, sizes) for axes in sharding.spec_for(logical, rules)]


def activation_splits(rules, sizes) -> Splits:
    """Splits of the activations as the model constrains them (models/llama.py)."""
    def past_tokens(*logical) -> int:
        return math.prod(_dim_splits(("batch", "length", *logical), rules, sizes)[2:])
    return Splits(embed=past_tokens("embed"), heads=past_tokens("heads", "head_dim"),
                  kv=past_tokens("kv_heads", "head_dim"), mlp=past_tokens("mlp"))


def _attention_scores(cfg: Config, split: Splits) -> float:
    """Bytes per token and layer of the attention's logits and probabilities: XLA's
    attention ("auto" is XLA too) holds a row of seq_len logits per head and query in
    fp32 whatever the compute dtype, and the probabilities at the compute width; cuDNN's
    fused kernel keeps neither."""
    m = cfg.model
    if m.attention_impl == "cudnn":
        return 0.0
    return m.num_heads / split.heads * cfg.seq_len * (4 + np.dtype(m.dtype).itemsize)


def _activation_bytes_per_layer_token(cfg: Config, split: Splits, remat: str) -> float:
    """Bytes one layer keeps per token for the backward pass under the policy `remat`."""
    m = cfg.model
    width = np.dtype(m.dtype).itemsize
    embed = m.embed_dim / split.embed
    heads = m.num_heads * m.head_dim / split.heads
    kv = 2 * m.num_kv_heads * m.head_dim / split.kv
    mlp = m.mlp_dim / split.mlp
    scores = _attention_scores(cfg, split)
    logits = scores * 4 / (4 + width)  # the fp32 part of them
    # The fused kernel's softmax statistics, one fp32 per head: its backward reads them
    # under any policy that does not recompute the attention.
    stats = m.num_heads / split.heads * 4 if m.attention_impl == "cudnn" else 0.0
    return {
        # Everything the backward pass reads: norms, residuals, q/k/v, attention, SwiGLU.
        "none": (5 * embed + 2 * heads + kv + 3 * mlp) * width + scores + stats,
        # Every matmul's output, the batched QK^T logits among them (or cuDNN's attention).
        "dots": (2 * embed + 2 * heads + kv + 2 * mlp) * width + logits + stats,
        # Unbatched matmuls only: not QK^T nor PV.
        "dots_no_batch": (2 * embed + heads + kv + 2 * mlp) * width,
        "full": embed * width,  # the layer's input only; the rest is recomputed
    }[remat]


def _gathered(layout, mesh, table) -> float:
    """Bytes of one weight a device holds while it is all-gathered for its use (fsdp):
    a weight split over a mesh axis that the batch is split over too is gathered whole
    along that axis, keeping only its other splits (tensor): the embedding and head whole,
    stacked layers one at a time. Under whatever config.sharding.rules say, not only fsdp."""
    gather = {a for a in sharding.mesh_axes(table.get("batch")) if mesh.shape[a] > 1}
    stacked = layout.logical[0] == "layers"
    dims = [sharding.mesh_axes(axes) for axes in layout.spec][1 if stacked else 0:]
    if not any(a in gather for axes in dims for a in axes):
        return 0.0  # held whole already (its bytes_per_device)
    kept = math.prod(mesh.shape[a] for axes in dims for a in axes if a not in gather)
    return layout.bytes / (layout.shape[0] if stacked else 1) / kept


def estimate(cfg: Config, layouts, mesh) -> Estimate:
    """Per-device bytes of parameters, Adam's two moments, gradients and activations."""
    params = sum(l.bytes_per_device for l in layouts)
    # Per layer slot of the stacked layers: a pipeline's stack has padding slots
    # (uneven config.pipeline.stage_layers), more than config.model.num_layers.
    layer_params = sum(l.bytes_per_device / l.shape[0] for l in layouts if l.logical[0] == "layers")
    # The activations split as config.sharding.rules split their axes (not as the default
    # rules would: a rule edited for an experiment changes what each device holds).
    # A mesh axis splits one dimension of an activation, the first that names it
    # (sharding.spec_for): with length on tensor, the heads are not split by it too.
    table = dict(cfg.sharding.rules)
    rows, positions = _dim_splits(("batch", "length"), cfg.sharding.rules, mesh.shape)
    batch_shards = rows * positions  # rows x positions of a device's tokens
    split = activation_splits(cfg.sharding.rules, mesh.shape)
    per_token_layer = _activation_bytes_per_layer_token(cfg, split, cfg.model.remat)
    m = cfg.model
    # One layer's full working set is live while the backward pass recomputes or
    # consumes it, with the gradients of its attention logits and probabilities beside
    # them, plus the output's fp32 logits and their gradient.
    working = _activation_bytes_per_layer_token(cfg, split, "none") + _attention_scores(cfg, split)
    logits = 2 * 4 * m.vocab_size / _dim_splits(("batch", "length", "vocab"), cfg.sharding.rules, mesh.shape)[2]
    stages = mesh.shape["pipeline"]
    if stages > 1:
        # hetjax.pipeline.spmd: a stage stashes the input of each micro-batch in flight and
        # recomputes one chunk of its layers for each backward, one micro-batch at a time.
        from hetjax.pipeline.schedule import make_schedule
        p, V = cfg.pipeline, virtual_stages(cfg, stages)
        slots = make_schedule(p.schedule, stages, p.microbatches, V).slots()[3]
        rows = next(l.shape[0] for l in layouts if l.logical[0] == "layers")  # padding slots too
        tokens = math.ceil(cfg.batch_size / p.microbatches / batch_shards) * cfg.seq_len
        stash = slots * m.embed_dim * np.dtype(m.dtype).itemsize
        activations = tokens * (stash + rows // stages // V * per_token_layer + working + logits)
        layer_activations = tokens * per_token_layer / (stages * V)  # a stage's chunk holds 1/(S V) of them
    else:
        tokens = math.ceil(cfg.batch_size / cfg.optim.grad_accum_steps / batch_shards) * cfg.seq_len
        if cfg.pipeline.split_backward and cfg.hetero.islands:
            # An island's split backward (hetjax.pipeline.split) runs its layers written out,
            # remat aside, and holds per micro-batch B's residuals and W's inputs from the
            # forward, W's inputs and output gradients from B: each at most what a layer
            # keeps without remat, so at most twice that.
            per_token_layer = 2 * _activation_bytes_per_layer_token(cfg, split, "none")
        activations = tokens * (m.num_layers * per_token_layer + working + logits)
        layer_activations = tokens * per_token_layer
    accumulated = params if cfg.optim.grad_accum_steps > 1 else 0  # the micro-steps' sum beside each one's
    gathered = sum(_gathered(l, mesh, table) for l in layouts)
    return Estimate(
        parameters=params, optimizer=2 * params, gradients=params + accumulated,
        activations=int(activations),
        per_layer=int(4 * layer_params + layer_activations),
        devices=mesh.size, gathered=int(gathered))


def device_memory_bytes(cfg: Config, devices=None) -> tuple[int, str]:
    """Memory one device may use, and where that figure came from."""
    if cfg.device_memory_gib > 0:
        return int(cfg.device_memory_gib * GiB), "config.device_memory_gib"
    device = (devices or jax.local_devices())[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]), f"{device.device_kind} memory"
    # Virtual CPU devices share the host's memory.
    host = _host_available_bytes()
    n = jax.local_device_count()
    return host // n, f"host memory {host / GiB:.1f} GiB shared by {n} local CPU device(s)"


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):  # not Linux: total memory instead
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(cfg: Config, est: Estimate, mesh) -> None:
    """Raises DoesNotFit naming what is needed and what would fit."""
    limit, source = device_memory_bytes(cfg, list(mesh.devices.flat))
    budget = cfg.memory_fraction * limit
    if est.total <= budget:
        return
    # Full FSDP over k devices divides state and (while the batch allows) activations by k;
    # k must split the batch's rows (41 devices cannot take 16 rows, nor can 32).
    need_devices = math.ceil(est.total * est.devices / budget)
    rows = cfg.batch_size // cfg.optim.grad_accum_steps
    splits = [k for k in range(need_devices, rows + 1) if rows % k == 0]
    # An island's split backward ignores remat (hetjax.pipeline.split): turning it off is the saving.
    recompute = ("config.pipeline.split_backward=False, which lets config.model.remat apply"
                 if cfg.pipeline.split_backward and cfg.hetero.islands
                 else "recompute more (config.model.remat='full')")
    devices_hint = (f"about {splits[0]} devices of this size with the model sharded over config.mesh.fsdp" if splits
                    else f"not even {rows} devices, one row each (the most a batch of config.batch_size={cfg.batch_size}"
                         f" splits over), with the model sharded over config.mesh.fsdp: lower config.seq_len or "
                         f"the model, or {recompute}")
    fixed = est.total - cfg.model.num_layers * est.per_layer
    max_layers = int((budget - fixed) // est.per_layer) if est.per_layer else 0
    pin = ""
    if mesh.shape["pipeline"] > 1:  # a count the stages (and their chunks) split evenly
        S, V = mesh.shape["pipeline"], virtual_stages(cfg, mesh.shape["pipeline"])
        max_layers -= max_layers % (S * V)
        fewer = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=max(max_layers, 1)))
        if virtual_stages(fewer, S) != V:  # automatic chunks would change with the count: keep those costed
            pin = f" --config.pipeline.virtual_stages={V}"
    layer_hint = (f"--config.model.num_layers={max_layers}{pin}" if max_layers >= 1 else
                  "not even one layer fits: lower config.batch_size or config.seq_len")
    raise DoesNotFit(
        f"config {cfg.name!r} needs about {est.describe()} on a mesh of {est.devices} device(s), "
        f"but each device has {limit / GiB:.1f} GiB ({source}; config.memory_fraction="
        f"{cfg.memory_fraction} of it is usable). What would fit: {devices_hint}; or on these devices {layer_hint}. "
        f"Nothing was allocated.")
