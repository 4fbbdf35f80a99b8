"""The optax chain built from the config: clipping, then AdamW on a warmup+cosine schedule."""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx

from hetjax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    learning_rate: float = 3e-4
    warmup_steps: int = 10
    decay_steps: int = 0  # updates until the cosine ends, warmup included; 0: config.steps (from data.start_step)
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # never applied to norms and biases
    grad_clip_norm: float = 1.0  # 0 disables clipping
    grad_accum_steps: int = 1  # micro-batches per step (the batch is split evenly)


def validate_optim(cfg: OptimConfig) -> None:
    """Refuses rates and coefficients that would train silently wrong (or diverge at
    step 1) before anything is compiled."""
    for name in ("learning_rate", "min_lr_ratio", "b1", "b2", "eps", "weight_decay", "grad_clip_norm"):
        value = getattr(cfg, name)  # finite: config.validate refuses any non-finite float first
        if value < 0:
            raise ConfigError(f"config.optim.{name}={value}: must not be negative")
    if cfg.eps <= 0:  # Adam divides by sqrt(v) + eps: a gradient of exactly 0 would give 0/0
        raise ConfigError(f"config.optim.eps={cfg.eps}: must be above 0 (e.g. 1e-8)")
    if cfg.min_lr_ratio > 1:
        raise ConfigError(f"config.optim.min_lr_ratio={cfg.min_lr_ratio}: the decay's end as a share of "
                          f"learning_rate must lie in [0, 1], e.g. 0.1")
    for name in ("b1", "b2"):
        if getattr(cfg, name) >= 1:
            raise ConfigError(f"config.optim.{name}={getattr(cfg, name)}: must be in [0, 1) (e.g. 0.9)")
    for name in ("warmup_steps", "decay_steps"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"config.optim.{name}={getattr(cfg, name)}: must not be negative")
    if 0 < cfg.decay_steps <= cfg.warmup_steps:  # the cosine would fall to its floor in one step
        raise ConfigError(f"config.optim.decay_steps={cfg.decay_steps} is not above config.optim.warmup_steps="
                          f"{cfg.warmup_steps}: it counts from step 0, warmup included; give the step where "
                          f"the decay ends (e.g. {cfg.warmup_steps + 10 * max(cfg.decay_steps, 1)}) or 0 for "
                          f"the whole run")


def learning_rate_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then cosine decay to `min_lr_ratio` of it."""
    decay_steps = max(cfg.decay_steps or total_steps, cfg.warmup_steps + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=decay_steps, end_value=cfg.learning_rate * cfg.min_lr_ratio)


def updates_applied(opt_state):
    """How many updates the optimizer's schedule has applied: the step whose rate the next
    update takes (a run started at config.data.start_step counts from 0 there, and so does
    its resume, where TrainState.step is the loop's step)."""
    found = [s.count for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
             if isinstance(s, optax.ScaleByScheduleState)]
    assert len(found) == 1, f"expected one schedule in the optimizer state, found {len(found)}"
    return found[0]


def decay_mask(params):
    """True where weight decay applies: every weight except norm scales and biases."""
    def is_weight(path, _):
        name = str(path[-1].key if hasattr(path[-1], "key") else path[-1])
        return not (name.startswith("scale") or "bias" in name)
    return jax.tree_util.tree_map_with_path(
        is_weight, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    if cfg.grad_clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
    return adamw
