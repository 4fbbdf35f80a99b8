"""Experiment configs: typed, frozen dataclasses built by a file's `get_config()`.

Each part owns its section (models.llama.ModelConfig, hetjax.mesh.MeshConfig, ...,
hetjax.hetero.config.HeteroConfig); this module composes them into `Config`, loads a
config file, applies `--config.a.b=v` overrides (parsed and checked against the
field's type; an unknown key names the closest existing ones) and validates the whole.
The command line itself is hetjax/cli.py.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

from hetjax.checkpoint_config import CheckpointConfig, validate_checkpoint
from hetjax.compile.config import CompileConfig, validate_compile
from hetjax.data.config import DATA_SOURCES, DataConfig, validate_data
from hetjax.errors import ConfigError
from hetjax.hetero import placement
from hetjax.hetero.config import (PLACEMENTS, PLATFORMS, HeteroConfig, IslandConfig, island_mesh_sizes,
                                  validate_hetero)
from hetjax.mesh import MESH_AXES, MeshConfig, validate_mesh
from hetjax.metrics import WandbConfig, validate_wandb
from hetjax.models.llama import ModelConfig, validate_model
from hetjax.optim import OptimConfig, validate_optim
from hetjax.pipeline.config import PIPELINE_SCHEDULES, PipelineConfig, validate_pipeline
from hetjax.sharding import DEFAULT_RULES, ShardingConfig, validate_sharding
from hetjax.transfer.link import BACKENDS, CHECKSUMS, LinkConfig

# What `from hetjax.config import ...` gave before the sections moved to their parts
# (config files and users' code import them from here).
__all__ = [
    "BACKENDS", "CHECKSUMS", "DATA_SOURCES", "DEFAULT_RULES", "MESH_AXES", "PIPELINE_SCHEDULES",
    "PLACEMENTS", "PLATFORMS", "CheckpointConfig", "CompileConfig", "Config", "ConfigError",
    "DataConfig", "HeteroConfig", "IslandConfig", "LinkConfig", "MeshConfig", "ModelConfig",
    "OptimConfig", "PipelineConfig", "ShardingConfig", "WandbConfig", "find_config_file", "island_mesh_sizes",
    "load", "override", "save", "to_dict", "validate",
]


@dataclasses.dataclass(frozen=True)
class Config:
    """One experiment: every part's section plus the run's own settings."""

    name: str = "tiny"
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    sharding: ShardingConfig = ShardingConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    compile: CompileConfig = CompileConfig()
    pipeline: PipelineConfig = PipelineConfig()
    seed: int = 0  # parameter initialisation
    steps: int = 100
    batch_size: int = 8  # global, in sequences
    seq_len: int = 64
    log_every: int = 10
    eval_every: int = 50  # 0 disables eval
    eval_batches: int = 2
    run_dir: str = "runs/tiny"
    tensorboard: bool = True
    # Memory check: refuse to start when the estimate exceeds this share of device memory.
    memory_fraction: float = 0.9
    device_memory_gib: float = 0.0  # 0: ask the device (on CPU: host memory / local devices)
    peak_tflops: float = 0.0  # per device for MFU; 0: the platform table (CPU: measured)
    checkpoint: CheckpointConfig = CheckpointConfig()
    init_from: str = ""  # start a new run from these saved weights (fresh optimizer, step 0)
    hetero: HeteroConfig = HeteroConfig()
    fingerprint_every: int = 50  # parameter digest + norms every N steps (hetjax.repro); 0: first and last only
    profile_steps: str = ""  # "A:B": trace steps A..B-1 (jax.profiler; islands: hetjax.hetero.timeline too)
    wandb: WandbConfig = WandbConfig()  # Weights & Biases, off until wandb.project is set


# ---------------------------------------------------------------------------
# Loading a config file


def find_config_file(name: str) -> Path:
    """`configs/tiny.py`, `tiny.py` and `tiny` all find the same file; a path with a folder
    other than configs/ (`../exp/tiny`) is that file or none, never the shipped one."""
    stem = name if name.endswith(".py") else name + ".py"
    candidates = [Path(name), Path(stem)]
    # The shipped configs: configs/ of a checkout, or hetjax/configs/ of an installed wheel.
    here = Path(importlib.util.find_spec("hetjax.configs").submodule_search_locations[0])
    if Path(stem).parent in (Path("."), Path("configs")):
        candidates += [Path("configs") / stem, here / stem, here / Path(stem).name]
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.stem for p in here.glob("*.py") if p.stem != "__init__")
    raise ConfigError(f"--config={name!r}: no such config file; known configs: {', '.join(known)}")


def load(name: str, overrides: dict[str, str] | None = None) -> Config:
    """Runs `get_config()` from a config file and applies `--config.a.b=v` overrides."""
    path = find_config_file(name)
    spec = importlib.util.spec_from_file_location(f"hetjax_config_{path.stem}", path)
    if spec is None:  # not a .py file: a run's config.json, say
        raise ConfigError(f"--config={name!r}: a config is a .py file defining get_config() (configs/tiny.py); "
                          f"a run's config.json records a config, it does not load as one")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"--config={name!r}: {path} defines no get_config()")
    cfg = module.get_config()
    for key, value in (overrides or {}).items():
        cfg = override(cfg, key, value)
    return cfg


def override(cfg, key: str, text: str, _prefix: str = ""):
    """Returns cfg with dotted `key` set to `text` parsed as that field's type."""
    head, _, rest = key.partition(".")
    full = _prefix + head
    fields = [f.name for f in dataclasses.fields(cfg)]
    if head not in fields:
        close = difflib.get_close_matches(head, fields, n=3, cutoff=0.5)
        hint = (f"did you mean {' or '.join(_prefix + c for c in close)}?" if close
                else f"known keys: {', '.join(_prefix + f for f in fields)}")
        raise ConfigError(f"unknown config key {_prefix + key!r}; {hint}")
    current = getattr(cfg, head)
    if rest:
        if not dataclasses.is_dataclass(current):
            inside = (" of sections: override them in a config file of your own, whose get_config() "
                      "returns dataclasses.replace() of a shipped one (configs/tiny_hetero.py shows how they "
                      "are built)") if isinstance(current, tuple) and any(map(dataclasses.is_dataclass, current)) else ""
            raise ConfigError(f"config key {full!r} is a {type(current).__name__}{inside}; it has no field {rest!r}")
        return dataclasses.replace(cfg, **{head: override(current, rest, text, full + ".")})
    if dataclasses.is_dataclass(current):
        first = dataclasses.fields(current)[0].name
        raise ConfigError(f"config key {full!r} is a section; set one of its fields, e.g. --config.{full}.{first}=...")
    typ = typing.get_type_hints(type(cfg))[head]
    return dataclasses.replace(cfg, **{head: _parse(full, text, typ)})


def _parse(key: str, text: str, typ) -> Any:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if text in ("None", "none", "null"):
            return None
        return _parse(key, text, args[0])
    if typ is bool:
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
    elif typ is str:
        return text
    elif typ in (int, float):
        try:
            value = ast.literal_eval(text)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError
            if typ is int and value != int(value):
                raise ValueError
            value = typ(value)
        except (ValueError, SyntaxError, OverflowError):
            value = _nonfinite(text) if typ is float else None
        if value is not None:
            if not math.isfinite(value):
                raise ConfigError(f"--config.{key}={text!r}: not finite; give a finite number")
            return value
    elif typ is tuple or typing.get_origin(typ) is tuple:
        try:
            value = ast.literal_eval(text)
            if isinstance(value, (list, tuple)):
                return _tuplify(value)
        except (ValueError, SyntaxError):
            pass
    name = getattr(typ, "__name__", str(typ))
    article = "an" if name[:1] in "aeiou" else "a"
    example = {"bool": " (true/false, yes/no or 1/0)",
               "tuple": f" such as ({text},) or (1, 2)"}.get(getattr(typing.get_origin(typ), "__name__", name), "")
    raise ConfigError(f"--config.{key}={text!r}: expected {article} {name}{example}")


def _nonfinite(text: str) -> float | None:
    # `nan`, `inf`, `-Infinity`: Python names, not literals, but someone will type them.
    try:
        value = float(text)
    except ValueError:
        return None
    return None if math.isfinite(value) else value


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, (list, tuple)) else value


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save(cfg: Config, path: Path) -> None:
    """Writes the resolved config as JSON (what actually ran, overrides included)."""
    path.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


# ---------------------------------------------------------------------------
# Validation that needs no devices: each part's own checks, then those across parts.


def validate(cfg: Config) -> None:
    """Checks everything that can be checked from the config alone."""
    _validate_values(cfg)
    validate_model(cfg.model)
    _validate_run(cfg)
    if cfg.optim.grad_accum_steps <= 0:
        raise ConfigError(f"config.optim.grad_accum_steps={cfg.optim.grad_accum_steps}: must be positive")
    if cfg.batch_size % cfg.optim.grad_accum_steps:
        raise ConfigError(
            f"config.batch_size={cfg.batch_size} is not divisible by "
            f"config.optim.grad_accum_steps={cfg.optim.grad_accum_steps}")
    validate_optim(cfg.optim)
    validate_mesh(cfg.mesh)
    validate_pipeline(cfg)
    validate_sharding(cfg.sharding, cfg.model.dims())
    if cfg.sharding.grad_sync == "once" and cfg.model.attention_impl == "cudnn":
        # jax 0.10's batching rule for cuDNN attention reshapes its (rows, 1, T, T) segment bias
        # to (rows, heads, T, T), which fails under the vmap that `once` runs each shard in.
        raise ConfigError("config.sharding.grad_sync='once' with config.model.attention_impl='cudnn': 'once' runs "
                          "each data shard's step under jax.vmap, which jax's cuDNN attention cannot batch with "
                          "a segment mask; use attention_impl='xla' or grad_sync='per_layer'")
    validate_compile(cfg.compile)
    validate_data(cfg)
    validate_checkpoint(cfg.checkpoint)
    validate_hetero(cfg)
    if cfg.hetero.islands and cfg.hetero.placement == "data":
        placement.batch_shares(cfg)  # a batch no share of the islands splits is refused before any device starts
    validate_wandb(cfg.wandb)


def _validate_run(cfg: Config) -> None:
    """The run's own settings (the sections check theirs)."""
    for key in ("steps", "batch_size", "seq_len", "log_every"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"config.{key}={getattr(cfg, key)}: must be positive")
    if cfg.eval_every < 0:
        raise ConfigError(f"config.eval_every={cfg.eval_every}: use 0 (no evaluation) or a positive step count")
    if cfg.eval_every and cfg.eval_batches <= 0:
        raise ConfigError(f"config.eval_batches={cfg.eval_batches}: must be positive while config.eval_every="
                          f"{cfg.eval_every} (or set config.eval_every=0 to evaluate never)")
    if not 0 <= cfg.seed < 2**32:
        raise ConfigError(f"config.seed={cfg.seed}: use an integer in [0, 2**32)")
    if not cfg.run_dir.strip():
        raise ConfigError("config.run_dir='': give the run's directory, e.g. --config.run_dir=runs/NAME "
                          "(an empty one would write checkpoints and logs into the current directory)")
    if not 0 < cfg.memory_fraction <= 1:
        raise ConfigError(f"config.memory_fraction={cfg.memory_fraction}: the share of device memory a run may "
                          f"plan for must lie in (0, 1], e.g. 0.9")
    for key, zero in (("device_memory_gib", "ask the device"), ("peak_tflops", "the platform's table")):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"config.{key}={getattr(cfg, key)}: must not be negative (0: {zero})")
    if cfg.fingerprint_every < 0:
        raise ConfigError(f"config.fingerprint_every={cfg.fingerprint_every}: use 0 (first and last "
                          f"step only) or a positive step count")
    _validate_profile_steps(cfg.profile_steps, cfg.steps, cfg.data.start_step)


def _validate_values(section, prefix: str = "config") -> None:
    """Checks every value against its field's type, as _parse checks an override: a
    config file's 2.5 steps or "16" rows fail here, naming the field, not in a compile."""
    for f in dataclasses.fields(section):
        _check_value(f"{prefix}.{f.name}", getattr(section, f.name), _hints(type(section))[f.name])


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _check_value(key: str, value, typ) -> None:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(typ):
            return
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    origin = typing.get_origin(typ) or typ
    if dataclasses.is_dataclass(origin):
        if not isinstance(value, origin):
            raise ConfigError(f"{key}={value!r}: expected a {origin.__name__}(...) section")
        _validate_values(value, key)
        return
    if origin is tuple:
        if not isinstance(value, tuple):
            raise ConfigError(f"{key}={value!r}: expected a tuple; write (a, b), not [a, b]")
        for i, item in enumerate(value):  # islands, links: sections in a tuple
            if dataclasses.is_dataclass(item):
                _validate_values(item, f"{key}[{i}]")
        return
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(origin)
    if ok is not None and not ok(value):
        article = "an" if origin.__name__[:1] in "aeiou" else "a"
        raise ConfigError(f"{key}={value!r}: expected {article} {origin.__name__}, got a {type(value).__name__}")
    # A config file's float('nan') or 1e999 is refused here as an override's is in _parse.
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value}: not finite; give a finite number")


def _validate_profile_steps(text: str, steps: int, start_step: int = 0) -> None:
    if not text:
        return
    a, colon, b = text.partition(":")
    if not (colon and a.strip().isdigit() and b.strip().isdigit() and int(a) < int(b)):
        raise ConfigError(f"config.profile_steps={text!r}: write A:B with 0 <= A < B, e.g. "
                          f"--config.profile_steps=10:13 to trace steps 10, 11 and 12")
    if int(a) >= steps:
        raise ConfigError(f"config.profile_steps={text!r}: step {int(a)} is not below config.steps={steps}, "
                          f"so no step would be traced; pick A < {steps}")
    if int(b) <= start_step:  # the run's first step is config.data.start_step
        raise ConfigError(f"config.profile_steps={text!r}: its last step {int(b) - 1} is before "
                          f"config.data.start_step={start_step}, the run's first step, so no step would be "
                          f"traced; pick B > {start_step}")
