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
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any
from hetjax.errors import ConfigError  # noqa: F401 - raised here, caught by callers


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


BACKENDS = ("local", "host", "direct")  # transfer backends (hetjax/transfer)
CHECKSUMS = ("xxh3", "crc32", "adler32")


@dataclasses.dataclass(frozen=True)
class LinkConfig:
    """One link between two islands (both ends use equal configs)."""

    backend: str = "host"  # local | host | direct
    streams: int = 2  # parallel TCP streams per pair of processes (host)
    # This process's NIC addresses: the endpoint listens on each, and stream i of a
    # peer goes to the peer's address i % len. Empty: bind_address only.
    nic_addresses: tuple = ()
    bind_address: str = "127.0.0.1"  # loopback by default: say so to open a link
    port: int = 0  # 0: any free port (the endpoint reports its addresses)
    secret_env: str = "HETJAX_TRANSFER_SECRET"  # the job's shared secret, from this variable...
    secret_file: str = ""  # ...or from this file when set
    timeout_s: float = 60.0  # host: a peer silent this long; direct: a whole pull; TransferTimeout
    chunk_bytes: int = 8 << 20  # unit of checksums and of copy/transfer overlap
    checksum: str = "xxh3"  # xxh3 (64-bit, ~80 GiB/s here) | crc32 (~7) | adler32 (~4), per chunk

    def validate(self, prefix: str = "link") -> None:
        """Raises ConfigError naming the field, the value and the fix."""
        if self.backend not in BACKENDS:
            raise ConfigError(f"{prefix}.backend={self.backend!r}: choose one of {BACKENDS}")
        if self.checksum not in CHECKSUMS:
            raise ConfigError(f"{prefix}.checksum={self.checksum!r}: choose one of {CHECKSUMS}")
        if not isinstance(self.streams, int) or not 1 <= self.streams <= 64:
            raise ConfigError(f"{prefix}.streams={self.streams!r}: use 1 to 64 parallel TCP streams")
        if not self.timeout_s > 0:
            raise ConfigError(f"{prefix}.timeout_s={self.timeout_s!r}: must be positive (seconds)")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 4096:
            raise ConfigError(f"{prefix}.chunk_bytes={self.chunk_bytes!r}: use at least 4096 (e.g. 8 << 20)")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"{prefix}.port={self.port}: use 0 (any free port) or 1..65535")
        if not isinstance(self.nic_addresses, tuple) or not all(isinstance(a, str) and a for a in self.nic_addresses):
            raise ConfigError(f"{prefix}.nic_addresses={self.nic_addresses!r}: a tuple of IP addresses, e.g. ('10.0.0.1', '10.0.1.1')")
        if not self.bind_address:
            raise ConfigError(f"{prefix}.bind_address is empty: give an IP address, e.g. '127.0.0.1'")

    @property
    def listen_addresses(self) -> tuple[str, ...]:
        return self.nic_addresses or (self.bind_address,)

    def secret(self, prefix: str = "link") -> bytes:
        """The job's shared secret; an empty or missing one is a ConfigError."""
        if self.secret_file:
            path = Path(self.secret_file)
            if not path.is_file():
                raise ConfigError(f"{prefix}.secret_file={self.secret_file!r}: no such file")
            value = path.read_bytes().strip()
            where = f"{prefix}.secret_file={self.secret_file!r}"
        else:
            value = os.environ.get(self.secret_env, "").encode()
            where = f"environment variable {self.secret_env} ({prefix}.secret_env)"
        if len(value) < 16:
            raise ConfigError(
                f"{where} holds no shared secret of at least 16 bytes; every process of the job "
                f"needs the same one, e.g. export {self.secret_env}=$(openssl rand -hex 32)")
        return value


@dataclasses.dataclass(frozen=True)
class IslandConfig:
    """A homogeneous part of the job: its own platform, jax.distributed world and mesh."""

    name: str = "island"
    platform: str = "cpu"  # cuda | rocm | cpu: the compile profile of this island
    num_processes: int = 1
    devices_per_process: int = 1
    mesh: MeshConfig = MeshConfig()  # over num_processes * devices_per_process devices
    speed: float = 1.0  # relative throughput: data shares and the default layer split

    @property
    def devices(self) -> int:
        """The island's devices, over all of its processes."""
        return self.num_processes * self.devices_per_process


@dataclasses.dataclass(frozen=True)
class HeteroConfig:
    """Islands joined by the transfer primitive (hetjax/hetero); no islands: one mesh."""

    islands: tuple = ()  # IslandConfigs, in pipeline order
    placement: str = "pipeline"  # pipeline: layers split over islands | data: the batch split
    island_layers: tuple = ()  # pipeline: layers per island; (): in proportion to speed
    auto_split: bool = False  # pipeline: measure each island's time per layer, split by that
    link: LinkConfig = LinkConfig(backend="local")  # every link between islands ...
    links: tuple = ()  # ... or one LinkConfig per neighbouring pair (island i, i+1)
    virtual: bool = True  # every island in this process, on a partition of its devices
    fingerprint_every: int = 10  # data placement: check islands hold identical parameters
    timeout_s: float = 120.0  # an island's own jax.distributed start, heartbeat and shutdown


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
    hetero: HeteroConfig = HeteroConfig()
    fingerprint_every: int = 50  # parameter digest + norms every N steps (hetjax.repro); 0: first and last only
    profile_steps: str = ""  # "A:B": trace steps A..B-1 (jax.profiler; islands: hetjax.hetero.timeline too)


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
    _validate_hetero(cfg)
    if cfg.fingerprint_every < 0:
        raise ConfigError(f"config.fingerprint_every={cfg.fingerprint_every}: use 0 (first and last "
                          f"step only) or a positive step count")
    _validate_profile_steps(cfg.profile_steps)


def _validate_profile_steps(text: str) -> None:
    if not text:
        return
    a, colon, b = text.partition(":")
    if not (colon and a.strip().isdigit() and b.strip().isdigit() and int(a) < int(b)):
        raise ConfigError(f"config.profile_steps={text!r}: write A:B with 0 <= A < B, e.g. "
                          f"--config.profile_steps=10:13 to trace steps 10, 11 and 12")


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


def island_mesh_sizes(island: IslandConfig) -> dict[str, int] | None:
    """The island's mesh axis sizes with -1 resolved; None if they cannot fill its devices."""
    devices = island.devices
    sizes = {a: getattr(island.mesh, a) for a in MESH_AXES}
    known = math.prod(s for s in sizes.values() if s != -1)
    wild = [a for a, s in sizes.items() if s == -1]
    if len(wild) > 1 or any(s == 0 or s < -1 for s in sizes.values()) or devices % known:
        return None
    if wild:
        sizes[wild[0]] = devices // known
    return sizes if math.prod(sizes.values()) == devices else None


PLACEMENTS = ("pipeline", "data")
PLATFORMS = ("cpu", "cuda", "rocm")


def _validate_hetero(cfg: Config) -> None:
    h = cfg.hetero
    if not h.islands:
        return
    n = len(h.islands)
    names = [getattr(i, "name", None) for i in h.islands]
    for k, island in enumerate(h.islands):
        where = f"config.hetero.islands[{k}]"
        if not isinstance(island, IslandConfig):
            raise ConfigError(f"{where}={island!r}: give an IslandConfig(name=..., platform=..., mesh=...)")
        if not island.name or not island.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{where}.name={island.name!r}: use letters, digits, - and _ (it names "
                              f"logs, checkpoint folders and transfer tags)")
        if names.count(island.name) > 1:
            raise ConfigError(f"{where}.name={island.name!r} is used twice; give every island its own name")
        if island.platform not in PLATFORMS:
            raise ConfigError(f"{where}.platform={island.platform!r}: choose one of {PLATFORMS}")
        for key in ("num_processes", "devices_per_process"):
            if not isinstance(getattr(island, key), int) or getattr(island, key) < 1:
                raise ConfigError(f"{where}.{key}={getattr(island, key)!r}: must be a positive integer")
        if not island.speed > 0:
            raise ConfigError(f"{where}.speed={island.speed!r}: must be positive (a relative throughput)")
        if island_mesh_sizes(island) is None:
            devices = island.devices
            raise ConfigError(
                f"{where}.mesh={island.mesh} does not fit the island's {island.num_processes} x "
                f"{island.devices_per_process} = {devices} devices; make the sizes multiply to "
                f"{devices} (one may be -1)")
        if h.placement == "data" and island.mesh.pipeline != 1:
            try:  # the island runs its own pipeline: the same rules as config.mesh.pipeline's
                _validate_pipeline(dataclasses.replace(cfg, mesh=island.mesh))
            except ConfigError as e:
                raise ConfigError(f"{where}.mesh.pipeline={island.mesh.pipeline}: {e}") from None
    if h.placement not in PLACEMENTS:
        raise ConfigError(f"config.hetero.placement={h.placement!r}: choose one of {PLACEMENTS}")
    if cfg.mesh.pipeline not in (1, -1):
        raise ConfigError(f"config.mesh.pipeline={cfg.mesh.pipeline} with config.hetero.islands: "
                          f"each island's mesh is its own (config.hetero.islands[k].mesh)")
    if h.placement == "pipeline":
        if n < 2:
            raise ConfigError("config.hetero.placement='pipeline' needs at least 2 islands (one per stage)")
        for k, island in enumerate(h.islands):
            if island.mesh.pipeline != 1:
                raise ConfigError(
                    f"config.hetero.islands[{k}].mesh.pipeline={island.mesh.pipeline}: with "
                    f"placement='pipeline' the islands are the stages; set it to 1 (a pipeline "
                    f"inside an island works with placement='data')")
        if h.island_layers and h.auto_split:
            raise ConfigError("config.hetero.island_layers and config.hetero.auto_split both split the "
                              "layers; set only one")
        if h.island_layers and (len(h.island_layers) != n or any(
                not isinstance(x, int) or x < 1 for x in h.island_layers)
                or sum(h.island_layers) != cfg.model.num_layers):
            raise ConfigError(
                f"config.hetero.island_layers={h.island_layers}: give one layer count >= 1 per "
                f"island ({n}) adding up to config.model.num_layers={cfg.model.num_layers}")
        if cfg.optim.grad_accum_steps != 1 or cfg.pipeline.stage_layers:
            raise ConfigError(
                f"config.optim.grad_accum_steps={cfg.optim.grad_accum_steps} / config.pipeline."
                f"stage_layers={cfg.pipeline.stage_layers} with placement='pipeline': the islands are "
                f"the stages; set config.pipeline.microbatches and config.hetero.island_layers instead")
        rows = cfg.batch_size // max(cfg.pipeline.microbatches, 1)
        for k, island in enumerate(h.islands):
            sizes = island_mesh_sizes(island)
            if rows % (sizes["data"] * sizes["fsdp"]):
                raise ConfigError(
                    f"a micro-batch of config.batch_size/config.pipeline.microbatches = {rows} rows does "
                    f"not split over config.hetero.islands[{k}]'s data x fsdp = "
                    f"{sizes['data'] * sizes['fsdp']} devices; raise config.batch_size or lower "
                    f"config.pipeline.microbatches")
        if cfg.model.num_layers < n:
            raise ConfigError(f"config.model.num_layers={cfg.model.num_layers} is fewer than the {n} "
                              f"islands of placement='pipeline'; every island needs a layer")
        schedule = cfg.pipeline.schedule
        if schedule not in ("gpipe", "1f1b"):
            raise ConfigError(f"config.pipeline.schedule={schedule!r} across islands: use 'gpipe' or "
                              f"'1f1b' (islands run their own operations without lockstep ticks)")
        if schedule == "1f1b" and cfg.pipeline.microbatches < n:
            raise ConfigError(f"config.pipeline.microbatches={cfg.pipeline.microbatches} is below the {n} "
                              f"islands: 1F1B never fills the pipeline; use at least {n}")
        if cfg.batch_size % cfg.pipeline.microbatches:
            raise ConfigError(f"config.batch_size={cfg.batch_size} is not divisible by "
                              f"config.pipeline.microbatches={cfg.pipeline.microbatches}")
    if h.links and len(h.links) != n - 1:
        raise ConfigError(f"config.hetero.links has {len(h.links)} entries for {n} islands: give one "
                          f"LinkConfig per neighbouring pair ({n - 1}), or set config.hetero.link for all")
    # Neighbours use links[k]; every other pair (and every pair without `links`) uses `link`.
    checked = [(f"config.hetero.links[{k}]", link) for k, link in enumerate(h.links)]
    if not h.links or n > 2:
        checked.append(("config.hetero.link", h.link))
    for where, link in checked:
        if not isinstance(link, LinkConfig):
            raise ConfigError(f"{where}={link!r}: give a LinkConfig(backend=...)")
        link.validate(where)
        if h.virtual and link.backend != "local":
            raise ConfigError(f"{where}.backend={link.backend!r} with config.hetero.virtual=True: virtual "
                              f"islands share one process, so use 'local'; or run real processes "
                              f"(config.hetero.virtual=False, python -m launch.local)")
        if not h.virtual and link.backend == "local":
            raise ConfigError(f"{where}.backend='local' with config.hetero.virtual=False: islands in "
                              f"separate processes need 'host' or 'direct'")
    if h.placement == "data" and len(set(h.links)) > 1:
        raise ConfigError("config.hetero.links: with placement='data' every island talks to every "
                          "other one; set one config.hetero.link")
    if h.fingerprint_every < 0:
        raise ConfigError(f"config.hetero.fingerprint_every={h.fingerprint_every}: use 0 (off) or a "
                          f"positive step count")
    if cfg.checkpoint.keep < 2:
        raise ConfigError(f"config.checkpoint.keep={cfg.checkpoint.keep} with islands: keep at least 2, "
                          f"so that a step every island finished survives one island dying mid-save")
    if not h.timeout_s > 0:
        raise ConfigError(f"config.hetero.timeout_s={h.timeout_s}: must be positive (seconds)")


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
    options: dict = dataclasses.field(default_factory=dict)  # the command's own --name=value


def run_main(main, errors: tuple = ()) -> int:
    """A command's exit status: main()'s, or 2 after `error: ...` for a ConfigError (the
    user's input), or 1 after it for one of `errors` (the run failed)."""
    try:
        return main()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except errors as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def parse_command_line(argv: list[str], flags: tuple[str, ...] = ("compile_only",),
                       options: dict | None = None) -> CommandLine:
    """Parses `--config X`, `--config.a.b=v` (or `--config.a.b v`), boolean flags, and the
    command's own options `--name=v` (or `--name v`), whose defaults `options` gives."""
    name, overrides, seen = None, {}, set()
    values = dict(options or {})
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
        elif key.startswith("--") and key.removeprefix("--").replace("-", "_") in values:
            if not eq:
                if not args:
                    raise ConfigError(f"{arg}: give a value, e.g. {arg}=VALUE")
                value = args.pop(0)
            values[key.removeprefix("--").replace("-", "_")] = value
        elif key.removeprefix("--").replace("-", "_") in flags and not eq:
            seen.add(key.removeprefix("--").replace("-", "_"))
        else:
            known = (["--config", "--config.KEY=VALUE"] + [f"--{f}" for f in flags]
                     + [f"--{o}=VALUE" for o in values])
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}"
            raise ConfigError(f"unknown argument {arg!r}; {hint}")
    if not name:
        raise ConfigError("--config is required, e.g. --config configs/tiny.py")
    return CommandLine(name, overrides, options=values, **{f: f in seen for f in flags})
