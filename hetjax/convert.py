"""Hugging Face Llama / Qwen2 checkpoints <-> hetjax orbax checkpoints.

    python -m hetjax.convert import HF_DIR OUT_DIR           # config.json + *.safetensors
    python -m hetjax.convert export CHECKPOINT HF_DIR [--dtype bfloat16] [--max_shard_gb 5]

Both directions stream: the importer reads the HF tensors of one hetjax parameter
(all layers of one weight), writes it with an orbax partial save and drops it;
the exporter restores one hetjax parameter at a time and writes its HF tensors one
by one into shards whose headers were planned from shapes alone. `import` writes
step 0 of a checkpoint directory that `--config.init_from=OUT_DIR` starts from.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.experimental.v1 import partial as ocp_partial

from hetjax import checkpoint, checkpoint_fit, checkpoint_init, cli, safetensors_io
from hetjax.repro import digest
from hetjax.errors import ConfigError, ConvertError  # noqa: F401 - raised here, caught by callers
from hetjax.models.llama import ModelConfig, validate_model


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors' names

# ---------------------------------------------------------------------------
# config.json <-> ModelConfig


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The hetjax ModelConfig of an HF Llama/Qwen2 config; refuses what it cannot represent."""
    kind = hf.get("model_type")
    if kind not in ("llama", "qwen2"):
        raise ConvertError(f"config.json: model_type={kind!r}; hetjax converts 'llama' and 'qwen2'")

    def refuse(field, value, why):
        raise ConvertError(f"config.json: {field}={value!r} is not supported: {why}")

    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", hf["hidden_act"], "hetjax's MLP is SwiGLU (silu)")
    if hf.get("mlp_bias"):
        refuse("mlp_bias", True, "hetjax's MLP has no biases")
    if kind == "llama" and hf.get("attention_bias"):
        refuse("attention_bias", True, "Llama's attention_bias adds an o_proj bias, which hetjax lacks")
    if hf.get("use_sliding_window"):
        refuse("use_sliding_window", True, "hetjax attends over the full context")
    if any(t != "full_attention" for t in hf.get("layer_types") or []) and hf.get("use_sliding_window", True):
        refuse("layer_types", hf["layer_types"], "hetjax has full attention in every layer")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        refuse("partial_rotary_factor", hf["partial_rotary_factor"], "hetjax rotates the whole head")
    # transformers 5 reads rope_scaling over rope_parameters, 4 rope_scaling only; hetjax's
    # export writes both: one edited and the other stale must not pick the model's RoPE.
    given = {k: _rope_fields(hf.get(k)) for k in ("rope_parameters", "rope_scaling")}
    if all(given.values()) and given["rope_parameters"] != given["rope_scaling"]:
        raise ConvertError(f"config.json: rope_scaling={hf['rope_scaling']!r} and rope_parameters="
                           f"{hf['rope_parameters']!r} disagree; transformers reads rope_scaling; make them "
                           f"agree, or delete the stale one")
    rope = dict(given["rope_scaling"] or given["rope_parameters"])
    rope["rope_theta"] = next((d["rope_theta"] for d in (hf.get("rope_parameters"), hf.get("rope_scaling"))
                               if isinstance(d, dict) and "rope_theta" in d), hf.get("rope_theta", 10_000.0))
    if missing := [k for k in ("vocab_size", "num_hidden_layers", "hidden_size", "intermediate_size",
                               "num_attention_heads") if k not in hf]:
        raise ConvertError(f"config.json has no {', '.join(missing)}; give a Llama or Qwen2 model's config")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = {}
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if missing := [k for k in keys if k not in rope]:
            refuse("rope_scaling", rope, f"llama3 RoPE needs {', '.join(keys)}; {', '.join(missing)} missing")
        scaling = dict(rope_scaling_factor=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_length=int(rope["original_max_position_embeddings"]))
    elif rope_type != "default":
        refuse("rope_scaling.rope_type", rope_type, "hetjax implements 'default' and 'llama3' RoPE")
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"], embed_dim=hf["hidden_size"],
        mlp_dim=hf["intermediate_size"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        qkv_bias=kind == "qwen2", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(rope["rope_theta"]), **scaling)


def _rope_fields(rope) -> dict:
    """A config.json's RoPE settings but their theta, `type` read as `rope_type`; {} for none
    or the default kind."""
    fields = {("rope_type" if k == "type" else k): v for k, v in (rope or {}).items() if k != "rope_theta"}
    return {} if fields in ({}, {"rope_type": "default"}) else fields


def hf_config_from_model(m: ModelConfig, dtype: str, base: dict | None = None) -> dict:
    """An HF config.json for `m`, keeping the other fields (token ids...) of `base`."""
    kind = "qwen2" if m.qkv_bias else "llama"
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling_factor != 1.0:
        rope.update(rope_type="llama3", factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                    high_freq_factor=m.rope_high_freq_factor,
                    original_max_position_embeddings=m.rope_original_max_length)
    out = dict(base or {})
    out.update(
        architectures=["Qwen2ForCausalLM" if m.qkv_bias else "LlamaForCausalLM"], model_type=kind,
        vocab_size=m.vocab_size, num_hidden_layers=m.num_layers, hidden_size=m.embed_dim,
        intermediate_size=m.mlp_dim, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim, hidden_act="silu", rms_norm_eps=m.norm_eps, tie_word_embeddings=m.tie_embeddings,
        rope_parameters=rope, dtype=dtype)
    out.pop("torch_dtype", None)  # the source's; older readers would take it over `dtype`
    # transformers before 5 (and readers following it) know RoPE only by these two keys:
    # without them they would run Llama-3 at the default theta, silently.
    out.update(rope_theta=m.rope_theta,
               rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"} if m.rope_scaling_factor != 1.0 else None)
    out.setdefault("max_position_embeddings", m.rope_original_max_length)
    if kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    return out


# ---------------------------------------------------------------------------
# Parameter names and layouts


@dataclasses.dataclass(frozen=True)
class Entry:
    path: str  # hetjax parameter, e.g. "blocks/attn/q_DNH"
    hf: str  # HF tensor name; "{i}" = layer index
    shape: tuple  # hetjax shape of one layer's slice
    hf_shape: tuple
    transpose: bool  # HF stores (out, in): hetjax = hf.T reshaped

    def to_hetjax(self, x):
        return (x.T if self.transpose else x).reshape(self.shape)

    def to_hf(self, x):
        if self.transpose:
            return x.reshape(self.hf_shape[::-1]).T
        return x.reshape(self.hf_shape)


def entries(m: ModelConfig) -> list[Entry]:
    D, F, N, K, H, V = m.embed_dim, m.mlp_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.vocab_size
    layer = "model.layers.{i}."
    out = [Entry("embed_VD", "model.embed_tokens.weight", (V, D), (V, D), False),
           Entry("blocks/attn_norm/scale_D", layer + "input_layernorm.weight", (D,), (D,), False),
           Entry("blocks/mlp_norm/scale_D", layer + "post_attention_layernorm.weight", (D,), (D,), False),
           Entry("blocks/attn/q_DNH", layer + "self_attn.q_proj.weight", (D, N, H), (N * H, D), True),
           Entry("blocks/attn/k_DKH", layer + "self_attn.k_proj.weight", (D, K, H), (K * H, D), True),
           Entry("blocks/attn/v_DKH", layer + "self_attn.v_proj.weight", (D, K, H), (K * H, D), True),
           Entry("blocks/attn/o_NHD", layer + "self_attn.o_proj.weight", (N, H, D), (D, N * H), True),
           Entry("blocks/mlp/gate_DF", layer + "mlp.gate_proj.weight", (D, F), (F, D), True),
           Entry("blocks/mlp/up_DF", layer + "mlp.up_proj.weight", (D, F), (F, D), True),
           Entry("blocks/mlp/down_FD", layer + "mlp.down_proj.weight", (F, D), (D, F), True),
           Entry("final_norm/scale_D", "model.norm.weight", (D,), (D,), False)]
    if m.qkv_bias:
        out += [Entry("blocks/attn/q_bias_NH", layer + "self_attn.q_proj.bias", (N, H), (N * H,), False),
                Entry("blocks/attn/k_bias_KH", layer + "self_attn.k_proj.bias", (K, H), (K * H,), False),
                Entry("blocks/attn/v_bias_KH", layer + "self_attn.v_proj.bias", (K, H), (K * H,), False)]
    if not m.tie_embeddings:
        out.append(Entry("unembed_DV", "lm_head.weight", (D, V), (V, D), True))
    return out


def _nested(path: str, leaf) -> dict:
    # hetjax parameters are nnx.Variables: orbax stores each as {"value": array}.
    tree = {"value": leaf}
    for part in reversed(path.split("/")):
        tree = {part: tree}
    return tree


def _layers(e: Entry, m: ModelConfig) -> list:
    return list(range(m.num_layers)) if e.path.startswith("blocks/") else [None]


# ---------------------------------------------------------------------------
# import / export


def import_hf(hf_dir: Path, out_dir: Path, param_dtype: str = "float32", log=print) -> ModelConfig:
    """Writes step 0 of an orbax checkpoint directory holding the HF model's weights."""
    hf_dir, out_dir = Path(hf_dir).absolute(), Path(out_dir).absolute()  # orbax takes absolute paths only
    if not (hf_dir / "config.json").exists():
        raise ConvertError(f"{hf_dir}: no config.json; give a Hugging Face model directory")
    hf_config = json.loads((hf_dir / "config.json").read_text())
    m = dataclasses.replace(model_config_from_hf(hf_config), param_dtype=param_dtype)
    try:  # what training would refuse (heads that do not group, an odd head_dim) is refused now
        validate_model(m)
    except ConfigError as e:
        raise ConvertError(f"{hf_dir}/config.json: {e}") from None
    files = safetensors_io.open_dir(hf_dir)
    plan = entries(m)
    wanted = {e.hf.format(i=i) for e in plan for i in _layers(e, m)}
    missing = sorted(wanted - set(files))
    if missing:
        raise ConvertError(f"{hf_dir}: tensors {missing[:4]} are missing (config.json says "
                           f"tie_word_embeddings={m.tie_embeddings}, {m.num_layers} layers)")
    extra = sorted(n for n in set(files) - wanted if not n.endswith("rotary_emb.inv_freq"))
    if m.tie_embeddings and "lm_head.weight" in extra:  # some tied checkpoints store the head too
        head, embed = (files[n].get(n) for n in ("lm_head.weight", "model.embed_tokens.weight"))
        if head.shape != embed.shape or not np.array_equal(head, embed):
            raise ConvertError(f"{hf_dir}: config.json says tie_word_embeddings=True, but lm_head.weight is not the "
                               f"embedding; set tie_word_embeddings to false if the head is its own")
        extra.remove("lm_head.weight")
    if extra:
        raise ConvertError(f"{hf_dir}: tensors {extra[:4]} have no place in a hetjax {hf_config['model_type']} model")
    if (out_dir / "0").exists():
        raise ConvertError(f"{out_dir}/0 already exists; choose an empty output directory")
    staging = out_dir / "0.import"
    shutil.rmtree(staging, ignore_errors=True)  # ours: a previous import that died midway
    hashes, shapes = {}, {}  # path -> hash, path -> ShapeDtypeStruct
    for e in plan:
        layers = _layers(e, m)
        x = np.empty(((len(layers),) if layers != [None] else ()) + e.shape, np.dtype(param_dtype))
        for i in layers:
            name = e.hf.format(i=i)
            if (kind := files[name].header[name].get("dtype")) not in FLOAT_DTYPES:  # int8 became float ones
                raise ConvertError(f"{name} has dtype {kind}: hetjax imports floating-point weights ({', '.join(FLOAT_DTYPES)}); "
                                   f"a quantized checkpoint (config.json's quantization_config) is not supported")
            t = files[name].get(name)
            if t.shape != e.hf_shape:
                raise ConvertError(f"{e.hf.format(i=i)} has shape {t.shape}, config.json implies {e.hf_shape}")
            x[() if i is None else i] = e.to_hetjax(t).astype(x.dtype)
        ocp_partial.save(staging, _nested(e.path, x))
        hashes.update(digest.leaf_checksums({e.path: x}))
        shapes[e.path] = jax.ShapeDtypeStruct(x.shape, x.dtype)
        log(f"  {e.path:26} {str(x.shape):22} <- {e.hf}")
        del x
    ocp_partial.finalize(staging)
    # Step 0 is put together under staging and renamed into out_dir whole: committed there
    # first, it would read as a checkpoint without params until they were moved in.
    manager = ocp.CheckpointManager(staging / "ck", item_handlers={"meta": ocp.JsonCheckpointHandler(),
                                                                   "config": ocp.JsonCheckpointHandler()})
    meta = {"step": 0, "checksums": {f"params/{k}": v for k, v in hashes.items()}, "hf_config": hf_config,
            "params_checksum": digest.params_checksum(shapes, hashes), "source": str(hf_dir)}
    manager.save(0, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta),
                                            config=ocp.args.JsonSave({"model": dataclasses.asdict(m)})))
    manager.close()
    (staging / "state").rename(staging / "ck" / "0" / "params")
    (staging / "ck" / "0").rename(out_dir / "0")
    shutil.rmtree(staging)
    return m


def export_hf(ckpt: Path, out_dir: Path, dtype: str = "float32", max_shard_bytes: int = 5 * 2**30,
              log=print) -> list[Path]:
    """Writes config.json and safetensors shards from the parameters of an orbax checkpoint."""
    directory, step = checkpoint_init.find_checkpoint_dir(Path(ckpt).absolute())  # orbax: absolute paths only
    manager = checkpoint.Manager(directory, read_only=True)
    try:
        if step is None and not manager.steps():
            raise checkpoint.CheckpointError(f"{directory} holds no checkpoint step")
        step = max(manager.steps()) if step is None else step
        small = manager.read_json(step, "meta", "config")
    finally:
        manager.close()
    checkpoint_fit.check_whole_model(small.config, manager.where(step))
    m = ModelConfig(**small.config["model"])
    plan = entries(m)
    # An uneven pipeline split saved its layers with padding rows between the stages.
    split = checkpoint_fit.padded_split(small.config)
    rows = checkpoint_fit.layer_rows(split) if split else np.arange(m.num_layers)
    out_dtype = _np_dtype(dtype)
    specs = [(e.hf.format(i=i), e.hf_shape, out_dtype) for e in plan for i in _layers(e, m)]
    params_dir = directory / str(step) / "params"
    reader = ocp.PyTreeCheckpointer()
    checksums = small.meta.get("checksums", {})

    def tensors():
        for e in plan:
            x = reader.restore(params_dir, args=ocp.args.PyTreeRestore(
                item=_nested(e.path, 0), restore_args=_nested(e.path, ocp.RestoreArgs(restore_type=np.ndarray)),
                partial_restore=True))
            x = np.asarray(_leaf(x, e.path))
            want = checksums.get(f"params/{e.path}")
            if want is not None and digest.leaf_checksums({e.path: x})[e.path] != want:
                raise ConvertError(f"{params_dir}: parameter {e.path} does not match its checksum; the checkpoint is damaged")
            log(f"  {e.path:26} {str(x.shape):22} -> {e.hf}")
            for i in _layers(e, m):
                yield e.to_hf(x if i is None else x[rows[i]]).astype(out_dtype)

    # Everything is written under a staging name and moved into place at the end,
    # config.json last: a failed export leaves no file that looks complete.
    out_dir = Path(out_dir).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / ".export.partial"
    shutil.rmtree(staging, ignore_errors=True)  # ours: an export that died midway
    try:
        paths = safetensors_io.write_dir(staging, specs, tensors(), max_shard_bytes)
        hf = hf_config_from_model(m, dtype, _base_hf_config(directory, small, log))
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    new = {p.name for p in staging.iterdir()}
    # An earlier export's weights that this one does not overwrite would be read instead of
    # it: transformers takes model.safetensors before an index, hetjax an index first.
    for old in [out_dir / safetensors_io.INDEX, *out_dir.glob("model*.safetensors")]:
        if old.name not in new and old.is_file():
            old.unlink()
    for name in sorted(new, key=lambda n: n == "config.json"):
        (staging / name).replace(out_dir / name)
    staging.rmdir()
    return [out_dir / p.name for p in paths]


def _found(*paths):
    """checkpoint_init.find_checkpoint_dir of the first of `paths` that holds a checkpoint."""
    for path in paths[:-1]:
        try:
            return checkpoint_init.find_checkpoint_dir(path)
        except ConfigError:
            pass
    return checkpoint_init.find_checkpoint_dir(paths[-1])


def _base_hf_config(directory: Path, small, log, hops: int = 4) -> dict | None:
    """The Hugging Face config this checkpoint's weights came from: the imported step keeps
    it, and a run started from it (config.init_from, followed back) inherits its token ids
    and context length. None, with a warning, when there is none."""
    meta, run = small.meta, small.config or {}
    while meta.get("hf_config") is None and run.get("init_from") and hops:
        hops -= 1
        try:
            # A relative init_from is the trainer's, relative to its cwd (recorded in the meta);
            # as given, for a run copied where that cwd is not.
            source, step = _found(Path(meta.get("cwd", "")) / run["init_from"], Path(run["init_from"]))
            manager = checkpoint.Manager(source, read_only=True)
            try:
                found = manager.read_json(max(manager.steps()) if step is None else step, "meta", "config")
            finally:
                manager.close()
        except (ConfigError, checkpoint.CorruptCheckpoint, ValueError):  # moved away since
            break
        meta, run = found.meta, found.config or {}
    if meta.get("hf_config") is None:
        log(f"warning: no Hugging Face config found for {directory} (neither it nor its config.init_from "
            f"chain was imported with `hetjax.convert import`); config.json gets transformers' defaults for "
            f"the token ids (bos, eos), and max_position_embeddings is config.model.rope_original_max_length: "
            f"check them before serving the model")
    return meta.get("hf_config")


def _leaf(tree, path):
    for part in path.split("/"):
        tree = tree[part]
    return tree["value"]


def _np_dtype(name: str):
    if name not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"--dtype={name!r}: choose float32, bfloat16 or float16")
    return np.dtype(safetensors_io.DTYPES[{"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[name]])


def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m hetjax.convert", description=__doc__.split("\n\n")[0],
                           example="python -m hetjax.convert import path/to/Llama-3.1-8B runs/llama8b-hf\n"
                                   "python -m hetjax.convert export runs/my-run hf-out --dtype bfloat16 --max_shard_gb 5")
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="HF directory -> orbax checkpoint directory (step 0)")
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("out_dir", type=Path)
    imp.add_argument("--param_dtype", default="float32", choices=("float32", "bfloat16"))
    exp = sub.add_parser("export", help="orbax checkpoint (run dir, checkpoint dir or step dir) -> HF directory")
    exp.add_argument("checkpoint", type=Path)
    exp.add_argument("out_dir", type=Path)
    exp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    exp.add_argument("--max_shard_gb", type=float, default=5.0)
    args = p.parse_args(argv)
    if args.command == "export" and not 0 < args.max_shard_gb < float("inf"):  # nan crashed, 0 made a shard a tensor
        print(f"error: --max_shard_gb={args.max_shard_gb}: give the largest shard in GB, more than 0 (e.g. 5)",
              file=sys.stderr)
        return 2
    try:
        if args.command == "import":
            m = import_hf(args.hf_dir, args.out_dir, args.param_dtype)
            # Every field that shapes the weights or the function they compute, whatever the
            # defaults: a config file (llama8b's, tiny's) sets its own.
            flags = " ".join(f"--config.model.{k}={v}" for k, v in dataclasses.asdict(m).items()
                             if k not in ("dtype", "param_dtype", "remat", "attention_impl"))
            print(f"wrote {args.out_dir}/0; train from it with --config.init_from={args.out_dir} {flags}")
        else:
            paths = export_hf(args.checkpoint, args.out_dir, args.dtype, int(args.max_shard_gb * 2**30))
            print(f"wrote {args.out_dir}/config.json and {len(paths)} safetensors file(s)")
    except (ConvertError, ConfigError, checkpoint.CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
