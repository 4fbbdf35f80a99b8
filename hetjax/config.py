"""Experiment configs: typed, frozen dataclasses built by a file's `get_config()`.

A config file is plain Python (`configs/tiny.py`) whose `get_config()` returns a
`Config`. Any field can be overridden from the command line as
`--config.model.num_layers=4`; values are parsed and checked against the field's
type, and an unknown key names the closest existing ones.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import types
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A user mistake in the config: the message names the field and the fix."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama 3 / Qwen2 decoder. Qwen2 = qkv_bias=True, rope_theta=1e6, no scaling."""

    vocab_size: int = 256
    num_layers: int = 2
    embed_dim: int = 64
    mlp_dim: int = 192
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    qkv_bias: bool = False
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling_factor: float = 1.0  # > 1 turns on Llama 3's frequency scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_length: int = 8192
    dtype: str = "float32"  # compute dtype: float32 or bfloat16
    param_dtype: str = "float32"  # master weights stay fp32
    remat: str = "none"  # per-layer policy: none | full | dots | dots_no_batch
    attention_impl: str = "auto"  # jax.nn.dot_product_attention: auto | xla | cudnn

    def dims(self) -> dict[str, tuple[str, int]]:
        """Logical axis -> (config field, size), for divisibility checks."""
        return {
            "vocab": ("model.vocab_size", self.vocab_size),
            "embed": ("model.embed_dim", self.embed_dim),
            "mlp": ("model.mlp_dim", self.mlp_dim),
            "heads": ("model.num_heads", self.num_heads),
            "kv_heads": ("model.num_kv_heads", self.num_kv_heads),
            "head_dim": ("model.head_dim", self.head_dim),
            "layers": ("model.num_layers", self.num_layers),
        }


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the named mesh axes; one of them may be -1 (all remaining devices)."""

    pipeline: int = 1
    data: int = 1
    fsdp: int = -1
    tensor: int = 1


DEFAULT_RULES = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    # Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
    # A mesh axis already used by an earlier dimension of the same array is skipped.
    rules: tuple = DEFAULT_RULES
    # Refuse layouts that leave more than this share of parameter bytes unsplit by
    # any non-`data` mesh axis (only checked when such axes have size > 1).
    max_replicated_fraction: float = 0.1


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    learning_rate: float = 3e-4
    warmup_steps: int = 10
    decay_steps: int = 0  # 0: decay over the whole run (config.steps)
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # never applied to norms and biases
    grad_clip_norm: float = 1.0  # 0 disables clipping
    grad_accum_steps: int = 1  # micro-batches per step (the batch is split evenly)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data (hetjax/data): a source, a tokenizer, packing and grain workers."""

    seed: int = 0  # shuffling, the eval hold-out and the synthetic language
    source: str = "synthetic"  # synthetic | text | jsonl | array_record
    path: str = ""  # text/jsonl: comma-separated files or globs; array_record: prepare's directory
    eval_path: str = ""  # held-out data; empty: hold out eval_fraction of the documents
    eval_fraction: float = 0.01
    text_field: str = "text"  # jsonl: the field that holds a document's text
    tokenizer: str = "byte"  # byte | path to a tokenizer.json | path to a SentencePiece .model
    skip_bad_records: bool = False  # skip (and count) bad lines instead of stopping
    index_dir: str = ""  # where text/jsonl indexes are cached; empty: next to the data
    shuffle: bool = True  # a seeded permutation of the documents per epoch
    num_workers: int = 0  # grain worker processes; any number gives the same batches
    start_step: int = 0  # first step to train: its batch and all later ones, as if never stopped
    # The synthetic language (hetjax/data/synthetic.py): a seeded unifilar HMM.
    num_states: int = 32
    branching: int = 8  # tokens each hidden state can emit (Zipf-like probabilities)
    zipf_exponent: float = 1.0
    mean_doc_length: int = 48
    num_documents: int = 100_000  # per split


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Which backend profile (XLA flags, env vars) is set before jax starts, and the cache."""

    platform: str = "auto"  # auto (detect the installed plugin) | cpu | cuda | rocm
    deterministic: bool = False  # the profile's deterministic variant (repeatable reductions)
    cache: bool = True  # jax's persistent compilation cache
    cache_dir: str = ""  # "": <parent of run_dir>/.jax_cache/<platform>-jax<version>


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in `dir` (default: run_dir/checkpoints); a restarted run resumes."""

    every: int = 100  # save every N steps (and at the end, and on SIGTERM); 0: only those
    keep: int = 3  # keep the newest K ...
    keep_every: int = 0  # ... plus every M-th step (0: none)
    async_save: bool = True  # write in a background thread while training goes on
    dir: str = ""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Micro-batch schedule over the `pipeline` mesh axis (used when config.mesh.pipeline > 1)."""

    schedule: str = "1f1b"  # gpipe | 1f1b | 1f1b_fused (see hetjax/pipeline/schedule.py)
    microbatches: int = 4  # the global batch is split into this many micro-batches
    stage_layers: tuple = ()  # layers per stage, e.g. (3, 5); () splits num_layers evenly


@dataclasses.dataclass(frozen=True)
class Config:
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
    fingerprint_every: int = 50  # parameter digest + norms every N steps (hetjax.repro); 0: first and last only


# ---------------------------------------------------------------------------
# Loading a config file


def find_config_file(name: str) -> Path:
    """`configs/tiny.py`, `tiny.py` and `tiny` all find the same file."""
    candidates = [Path(name)]
    stem = name if name.endswith(".py") else name + ".py"
    here = Path(__file__).resolve().parent.parent / "configs"
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
            raise ConfigError(f"config key {full!r} is a {type(current).__name__}; it has no field {rest!r}")
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
            return typ(value)
        except (ValueError, SyntaxError):
            pass
    elif typ is tuple or typing.get_origin(typ) is tuple:
        try:
            value = ast.literal_eval(text)
            if isinstance(value, (list, tuple)):
                return _tuplify(value)
        except (ValueError, SyntaxError):
            pass
    name = getattr(typ, "__name__", str(typ))
    raise ConfigError(f"--config.{key}={text!r}: expected a {name}")


def _tuplify(value):
    return tuple(_tuplify(v) for v in value) if isinstance(value, (list, tuple)) else value


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save(cfg: Config, path: Path) -> None:
    """Writes the resolved config as JSON (what actually ran, overrides included)."""
    path.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


# ---------------------------------------------------------------------------
# Validation that needs no devices: types of values, ranges, consistency.

_CHOICES = {
    "model.dtype": ("float32", "bfloat16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.remat": ("none", "full", "dots", "dots_no_batch"),
    "model.attention_impl": ("auto", "xla", "cudnn"),
}
MESH_AXES = ("pipeline", "data", "fsdp", "tensor")


def validate(cfg: Config) -> None:
    """Checks everything that can be checked from the config alone."""
    m = cfg.model
    for key, choices in _CHOICES.items():
        value = getattr(m, key.split(".")[1])
        if value not in choices:
            raise ConfigError(f"config.{key}={value!r}: choose one of {choices}")
    positive = {
        "model.vocab_size": m.vocab_size, "model.num_layers": m.num_layers,
        "model.embed_dim": m.embed_dim, "model.mlp_dim": m.mlp_dim,
        "model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads,
        "model.head_dim": m.head_dim, "steps": cfg.steps, "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len, "log_every": cfg.log_every,
        "optim.grad_accum_steps": cfg.optim.grad_accum_steps,
        "data.branching": cfg.data.branching, "data.mean_doc_length": cfg.data.mean_doc_length,
        "data.num_states": cfg.data.num_states, "data.num_documents": cfg.data.num_documents,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config.{key}={value}: must be positive")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"config.model.num_heads={m.num_heads} is not a multiple of "
            f"config.model.num_kv_heads={m.num_kv_heads}: grouped-query attention shares each "
            f"KV head among an equal number of query heads")
    if m.head_dim % 2:
        raise ConfigError(f"config.model.head_dim={m.head_dim}: RoPE needs an even head_dim")
    if cfg.batch_size % cfg.optim.grad_accum_steps:
        raise ConfigError(
            f"config.batch_size={cfg.batch_size} is not divisible by "
            f"config.optim.grad_accum_steps={cfg.optim.grad_accum_steps}")
    sizes = [getattr(cfg.mesh, a) for a in MESH_AXES]
    if sum(s == -1 for s in sizes) > 1:
        raise ConfigError(f"config.mesh={cfg.mesh}: at most one axis may be -1")
    for axis, size in zip(MESH_AXES, sizes):
        if size == 0 or size < -1:
            raise ConfigError(f"config.mesh.{axis}={size}: use a positive size, or -1 for the remaining devices")
    _validate_pipeline(cfg)
    if not 0.0 <= cfg.sharding.max_replicated_fraction <= 1.0:
        raise ConfigError(
            f"config.sharding.max_replicated_fraction={cfg.sharding.max_replicated_fraction}: "
            f"must lie in [0, 1]")
    _validate_rules(cfg.sharding.rules, m)
    from hetjax.compile import profiles  # no jax import: safe before the backend starts
    if cfg.compile.platform != "auto":
        profiles.check_platform(cfg.compile.platform, "config.compile.platform")
    _validate_data(cfg)
    _validate_checkpoint(cfg.checkpoint)
    if cfg.fingerprint_every < 0:
        raise ConfigError(f"config.fingerprint_every={cfg.fingerprint_every}: use 0 (first and last "
                          f"step only) or a positive step count")


DATA_SOURCES = ("synthetic", "text", "jsonl", "array_record")


def _validate_data(cfg: Config) -> None:
    d = cfg.data
    if d.source not in DATA_SOURCES:
        raise ConfigError(f"config.data.source={d.source!r}: choose one of {DATA_SOURCES}")
    if d.source != "synthetic" and not d.path:
        raise ConfigError(f"config.data.source={d.source!r} needs config.data.path (files, globs "
                          f"or a prepared directory)")
    if d.source == "synthetic" and d.branching >= cfg.model.vocab_size:
        raise ConfigError(f"config.data.branching={d.branching}: must be below "
                          f"config.model.vocab_size={cfg.model.vocab_size} (token 0 is BOS)")
    if not 0.0 < d.eval_fraction < 1.0:
        raise ConfigError(f"config.data.eval_fraction={d.eval_fraction}: must lie in (0, 1)")
    for key in ("num_workers", "start_step"):
        if getattr(d, key) < 0:
            raise ConfigError(f"config.data.{key}={getattr(d, key)}: must be >= 0")
    if d.start_step >= cfg.steps:
        raise ConfigError(f"config.data.start_step={d.start_step}: must be below config.steps={cfg.steps}")


def _validate_checkpoint(c: CheckpointConfig) -> None:
    for key in ("every", "keep_every"):
        if getattr(c, key) < 0:
            raise ConfigError(f"config.checkpoint.{key}={getattr(c, key)}: use 0 (off) or a positive step count")
    if c.keep < 1:
        raise ConfigError(f"config.checkpoint.keep={c.keep}: keep at least 1 checkpoint, or resume is impossible")


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "1f1b_fused")


def _validate_pipeline(cfg: Config) -> None:
    p, stages = cfg.pipeline, cfg.mesh.pipeline
    if p.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"config.pipeline.schedule={p.schedule!r}: choose one of {PIPELINE_SCHEDULES}")
    if p.microbatches <= 0:
        raise ConfigError(f"config.pipeline.microbatches={p.microbatches}: must be positive")
    if stages == 1 or (stages == -1 and not p.stage_layers):
        return
    if cfg.optim.grad_accum_steps != 1:
        raise ConfigError(
            f"config.optim.grad_accum_steps={cfg.optim.grad_accum_steps} with config.mesh.pipeline="
            f"{stages}: the pipeline already splits the batch; set config.pipeline.microbatches instead")
    if p.stage_layers:
        if stages != -1 and len(p.stage_layers) != stages:
            raise ConfigError(
                f"config.pipeline.stage_layers={p.stage_layers} names {len(p.stage_layers)} stages "
                f"but config.mesh.pipeline={stages}; give one layer count per stage")
        if any(not isinstance(n, int) or n < 1 for n in p.stage_layers):
            raise ConfigError(f"config.pipeline.stage_layers={p.stage_layers}: every stage needs >= 1 layer")
        if sum(p.stage_layers) != cfg.model.num_layers:
            raise ConfigError(
                f"config.pipeline.stage_layers={p.stage_layers} adds up to {sum(p.stage_layers)} "
                f"layers but config.model.num_layers={cfg.model.num_layers}; make them add up")
        stages = len(p.stage_layers)
    elif cfg.model.num_layers % stages:
        raise ConfigError(
            f"config.model.num_layers={cfg.model.num_layers} does not split evenly into "
            f"config.mesh.pipeline={stages} stages; set config.pipeline.stage_layers (e.g. an "
            f"uneven split adding up to {cfg.model.num_layers}) or change the number of stages")
    if p.schedule.startswith("1f1b") and p.microbatches < stages:
        raise ConfigError(
            f"config.pipeline.microbatches={p.microbatches} is smaller than the {stages} pipeline "
            f"stages: 1F1B never fills the pipeline; use at least {stages} micro-batches, or "
            f"config.pipeline.schedule='gpipe'")
    if cfg.batch_size % p.microbatches:
        raise ConfigError(
            f"config.batch_size={cfg.batch_size} is not divisible by config.pipeline.microbatches="
            f"{p.microbatches}; make the batch a multiple of the micro-batch count")


def _validate_rules(rules, m: ModelConfig) -> None:
    names = set()
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[0], str)):
            raise ConfigError(
                f"config.sharding.rules[{i}]={rule!r}: each rule is (logical_axis, mesh_axes), "
                f"e.g. ('mlp', 'tensor') or ('batch', ('data', 'fsdp')) or ('length', None)")
        target = rule[1]
        targets = () if target is None else (target,) if isinstance(target, str) else target
        for axis in targets:
            if axis not in MESH_AXES:
                raise ConfigError(
                    f"config.sharding.rules[{i}]={rule!r}: {axis!r} is not a mesh axis; "
                    f"mesh axes are {MESH_AXES}")
        if rule[0] in names:
            raise ConfigError(f"config.sharding.rules: logical axis {rule[0]!r} appears twice")
        names.add(rule[0])
    required = set(m.dims()) | {"batch", "length"}
    for name in sorted(names - required):
        close = difflib.get_close_matches(name, required, n=2, cutoff=0.5)
        hint = f"did you mean {' or '.join(map(repr, close))}?" if close else f"known: {sorted(required)}"
        raise ConfigError(f"config.sharding.rules: unknown logical axis {name!r}; {hint}")
    missing = sorted(required - names)
    if missing:
        raise ConfigError(
            f"config.sharding.rules has no rule for logical axes {missing}; add e.g. "
            f"({missing[0]!r}, None) to replicate")


# ---------------------------------------------------------------------------
# The command line: --config FILE, --config.a.b=value overrides, flags.


@dataclasses.dataclass
class CommandLine:
    config: str
    overrides: dict[str, str]
    compile_only: bool = False


def parse_command_line(argv: list[str], flags: tuple[str, ...] = ("compile_only",)) -> CommandLine:
    """Parses `--config X`, `--config.a.b=v` (or `--config.a.b v`) and boolean flags."""
    name, overrides, seen = None, {}, set()
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        if key == "--config":
            name = value if eq else (args.pop(0) if args else None)
        elif key.startswith("--config."):
            if not eq:
                if not args:
                    raise ConfigError(f"{arg}: give a value, e.g. {arg}=VALUE")
                value = args.pop(0)
            overrides[key.removeprefix("--config.")] = value
        elif key.removeprefix("--").replace("-", "_") in flags and not eq:
            seen.add(key.removeprefix("--").replace("-", "_"))
        else:
            known = ["--config", "--config.KEY=VALUE"] + [f"--{f}" for f in flags]
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}"
            raise ConfigError(f"unknown argument {arg!r}; {hint}")
    if not name:
        raise ConfigError("--config is required, e.g. --config configs/tiny.py")
    return CommandLine(name, overrides, **{f: f in seen for f in flags})
