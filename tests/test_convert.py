"""Hugging Face interchange: logits match transformers; import/export/re-import is bit-exact."""

import dataclasses
import json
import math
import shutil

import jax
import numpy as np
import optax
import pytest

from hetjax import checkpoint_init, convert, safetensors_io
from hetjax.compile import aot
from hetjax.repro import digest
from hetjax import state as state_lib
from flax import nnx

from hetjax import config as config_lib
from hetjax.config import DEFAULT_RULES, MeshConfig, OptimConfig
from hetjax.mesh import make_mesh
from hetjax.optim import make_optimizer
from hetjax.sharding import state_shardings

torch = pytest.importorskip("torch", reason="torch is not installed (pip install -e '.[test]' brings it)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
MODELS = {
    # Llama 3.1 RoPE scaling (tiny original length so that scaling matters), untied head,
    # sharded safetensors with an index.
    "llama": lambda: transformers.LlamaConfig(**SHAPE, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    # Qwen2: q/k/v biases, tied embeddings, one safetensors file.
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True,
                                              rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


def hf_model(kind, directory):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[kind]()).eval()
    with torch.no_grad():  # random everything, biases and norms included
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(directory, max_shard_size="20KB" if kind == "llama" else "5GB")
    return model


def load(directory, m):
    mesh = make_mesh(MeshConfig(fsdp=1), jax.devices()[:1])
    graphdef, abstract = state_lib.abstract_state(m, 0, make_optimizer(OptimConfig(), 1))
    shardings = state_shardings(abstract, mesh, DEFAULT_RULES)
    return graphdef, checkpoint_init.load_params(directory, abstract.params, shardings.params, log=lambda _: None)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_imported_logits_match_transformers_and_the_round_trip_is_exact(tmp_path, kind):
    model = hf_model(kind, tmp_path / "hf")
    assert (tmp_path / "hf" / safetensors_io.INDEX).exists() == (kind == "llama")
    m = convert.import_hf(tmp_path / "hf", tmp_path / "ck", log=lambda _: None)
    assert m.qkv_bias == (kind == "qwen2") and m.tie_embeddings == (kind == "qwen2")
    assert m.rope_scaling_factor == (8.0 if kind == "llama" else 1.0)

    graphdef, params = load(tmp_path / "ck", m)
    tokens = np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (2, 24))
    ours = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)
    with torch.no_grad():
        theirs = model(torch.from_numpy(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=0)

    # Export (sharded, via the command line), load with transformers, compare tensors bit for bit.
    assert convert.main(["export", str(tmp_path / "ck"), str(tmp_path / "out"), "--max_shard_gb=0.00002"]) == 0
    assert (tmp_path / "out" / safetensors_io.INDEX).exists()
    # RoPE both as transformers 5 reads it and as earlier readers do (rope_theta, rope_scaling).
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["rope_parameters"] == model.config.rope_parameters
    assert exported["rope_theta"] == model.config.rope_parameters["rope_theta"] == m.rope_theta
    assert exported["rope_scaling"] == ({k: v for k, v in model.config.rope_parameters.items() if k != "rope_theta"}
                                        if kind == "llama" else None)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    theirs_sd, back_sd = model.state_dict(), back.state_dict()
    assert theirs_sd.keys() == back_sd.keys()
    for k in theirs_sd:
        assert torch.equal(theirs_sd[k], back_sd[k]), k
    # Re-import: the same parameters, bit for bit (same fingerprint and checksums).
    convert.import_hf(tmp_path / "out", tmp_path / "ck2", log=lambda _: None)
    metas = [json.loads((tmp_path / d / "0" / "meta" / "metadata").read_text()) for d in ("ck", "ck2")]
    assert metas[0]["params_checksum"] == metas[1]["params_checksum"]
    assert metas[0]["checksums"] == metas[1]["checksums"]
    assert metas[0]["params_checksum"] == digest.params_checksum(params)


def test_an_import_that_dies_before_its_params_are_in_leaves_no_step_behind(tmp_path, monkeypatch):
    """Step 0 was committed with its config and meta, and the params moved in after: an
    import killed between the two left a step without params, which a second import
    refused to overwrite and init_from reported unreadable."""
    from pathlib import Path
    hf_model("llama", tmp_path / "hf")
    rename = Path.rename

    def dies_moving_params(self, target):
        if Path(target).name == "params":
            raise KeyboardInterrupt  # as a kill would, midway
        return rename(self, target)
    with monkeypatch.context() as patched:
        patched.setattr(Path, "rename", dies_moving_params)
        with pytest.raises(KeyboardInterrupt):
            convert.import_hf(tmp_path / "hf", tmp_path / "ck", log=lambda _: None)
    assert not (tmp_path / "ck" / "0").exists()
    convert.import_hf(tmp_path / "hf", tmp_path / "ck", log=lambda _: None)  # again: complete
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["0"]
    assert {"params", "meta", "config"} <= {p.name for p in (tmp_path / "ck" / "0").iterdir()}


def test_bfloat16_weights_import_exactly(tmp_path):
    model = hf_model("qwen2", tmp_path / "f32")
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    m = convert.import_hf(tmp_path / "bf16", tmp_path / "ck", log=lambda _: None)
    _, params = load(tmp_path / "ck", m)
    q = np.asarray(params["blocks"]["attn"]["q_DNH"][...])[1]  # (D, N, H)
    hf_q = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # (N*H, D)
    np.testing.assert_array_equal(q, hf_q.T.reshape(q.shape))
    convert.export_hf(tmp_path / "ck", tmp_path / "out", dtype="bfloat16", log=lambda _: None)
    files = safetensors_io.open_dir(tmp_path / "out")
    name = "model.layers.1.self_attn.q_proj.weight"
    assert files[name].header[name]["dtype"] == "BF16"
    np.testing.assert_array_equal(files[name].get(name).astype(np.float32), hf_q)


def test_relative_paths_work_and_a_failed_export_leaves_nothing_complete(tmp_path, monkeypatch, capsys):
    hf_model("qwen2", tmp_path / "hf")
    monkeypatch.chdir(tmp_path)  # the README's form: paths relative to where one stands
    assert convert.main(["import", "hf", "runs/tiny-hf"]) == 0
    assert convert.main(["export", "runs/tiny-hf", "out"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    # Damage the saved checksum of the last parameter: the export fails after writing the others.
    m = convert.model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()))
    meta_path = tmp_path / "runs" / "tiny-hf" / "0" / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["checksums"][f"params/{convert.entries(m)[-1].path}"] = "0" * 16
    meta_path.write_text(json.dumps(meta))
    capsys.readouterr()
    assert convert.main(["export", "runs/tiny-hf", "out2"]) == 2
    assert "does not match its checksum" in capsys.readouterr().err
    assert list((tmp_path / "out2").iterdir()) == []


def test_exporting_again_into_a_directory_leaves_no_stale_weights(tmp_path):
    """transformers reads model.safetensors before an index, hetjax an index first: an
    earlier export's file that the new one does not overwrite would be loaded instead."""
    model = hf_model("qwen2", tmp_path / "hf")
    convert.import_hf(tmp_path / "hf", tmp_path / "ck", log=lambda _: None)
    out = tmp_path / "out"
    for shard in (5 * 2**30, 20_000, 5 * 2**30):  # one file, then shards, then one file again
        convert.export_hf(tmp_path / "ck", out, max_shard_bytes=shard, log=lambda _: None)
        files = sorted(p.name for p in out.iterdir())
        assert files == (["config.json", "model.safetensors"] if shard > 10**6 else
                         ["config.json", *sorted(p.name for p in out.glob("model-*-of-*.safetensors")),
                          safetensors_io.INDEX]), files
        if shard < 10**6:
            assert len(files) > 3
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def test_a_run_started_from_imported_weights_exports_the_original_token_ids(tmp_path, monkeypatch, capsys):
    """...and the import's hint gives every model field a config file may set otherwise
    (it listed only those unlike ModelConfig's defaults: tiny's norm_eps stayed 1e-5 against
    the import's 1e-6); a run whose norm or RoPE settings differ from the checkpoint's is warned."""
    from hetjax import train
    hf_model("qwen2", tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf.update(bos_token_id=5, eos_token_id=[6, 7], max_position_embeddings=131072)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf))
    monkeypatch.chdir(tmp_path)
    assert convert.main(["import", "hf", "imported"]) == 0
    hint = capsys.readouterr().out.split("--config.init_from=imported ")[1].split()
    assert "--config.model.norm_eps=1e-06" in hint and "--config.model.rope_theta=1000000.0" in hint
    # Given as the run's own checkpoints, the import was compiled for, then moved into
    # corrupt/ as "damaged" (no optimizer state, no data item). Now refused before that.
    with monkeypatch.context() as patched:
        patched.setattr(aot, "compile", lambda *a, **k: pytest.fail("compiled before refusing"))
        with pytest.raises(config_lib.ConfigError, match="holds weights only .* --config.init_from="):
            train.main(["--config", "tiny.py", "--config.steps=1", "--config.run_dir=run0",
                        "--config.checkpoint.dir=imported", "--config.data.branching=4", *hint])
    assert (tmp_path / "imported" / "0" / "params").is_dir() and not (tmp_path / "corrupt").exists()
    assert train.main(["--config", "tiny.py", "--config.steps=1", "--config.eval_every=0", "--config.tensorboard=false",
                       "--config.run_dir=run", "--config.init_from=imported", "--config.data.branching=4", *hint]) == 0
    assert "another function" not in capsys.readouterr().out
    m = config_lib.load("tiny.py", {a[9:].split("=")[0]: a.split("=")[1] for a in hint}).model
    _, abstract = state_lib.abstract_state(m, 0, optax.sgd(0.1))
    cpu = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    logged = []
    checkpoint_init.load_params("imported", abstract.params, jax.tree.map(lambda _: cpu, abstract.params), logged.append,
                           model=dataclasses.replace(m, norm_eps=1e-3, rope_theta=1e4))
    assert [line for line in logged if "--config.model.norm_eps=1e-06 (this run: 0.001), "
            "--config.model.rope_theta=1000000.0 (this run: 10000.0): these weights now compute another" in line]
    model = {"vocab_size": 64, "num_layers": 2, "embed_dim": 32, "mlp_dim": 48, "num_heads": 4, "num_kv_heads": 2,
             "head_dim": 8, "qkv_bias": True, "tie_embeddings": True, "rope_theta": 1e6}
    logged = []
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # init_from='imported' is the trainer's, relative to its cwd
    convert.export_hf(tmp_path / "run", tmp_path / "out", log=logged.append)
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (out["bos_token_id"], out["eos_token_id"], out["max_position_embeddings"]) == (5, [6, 7], 131072)
    assert not [line for line in logged if "no Hugging Face config" in line]
    # A run copied where its trainer's cwd is not: init_from is then taken as given (from here).
    monkeypatch.chdir(tmp_path)
    for meta in (tmp_path / "run" / "checkpoints").glob("*/meta/metadata"):
        meta.write_text(json.dumps(dict(json.loads(meta.read_text()), cwd="/nonexistent/trainer")))
    convert.export_hf(tmp_path / "run", tmp_path / "out3", log=logged.append)
    out = json.loads((tmp_path / "out3" / "config.json").read_text())
    assert (out["bos_token_id"], out["eos_token_id"]) == (5, [6, 7])
    # A run with no imported ancestor says so.
    assert train.main(["--config", "tiny.py", "--config.steps=1", "--config.eval_every=0", "--config.tensorboard=false",
                       "--config.run_dir=scratch", "--config.data.branching=4",
                       *[f"--config.model.{k}={v}" for k, v in model.items()]]) == 0
    convert.export_hf(tmp_path / "scratch", tmp_path / "out2", log=logged.append)
    warned = [line for line in logged if "no Hugging Face config found" in line]
    # It said max_position_embeddings took transformers' default; it is the model's RoPE length.
    written = json.loads((tmp_path / "out2" / "config.json").read_text())["max_position_embeddings"]
    assert written == config_lib.load("tiny.py").model.rope_original_max_length
    assert warned and "max_position_embeddings is config.model.rope_original_max_length" in warned[0]


@pytest.mark.parametrize("field, value, message", [
    ("model_type", "mistral", "model_type='mistral'"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, "rope_scaling.rope_type='yarn'"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("attention_bias", True, "o_proj bias"),
])
def test_unsupported_hf_fields_are_refused_by_name(field, value, message):
    hf = transformers.LlamaConfig(**SHAPE).to_dict()
    hf[field] = value
    with pytest.raises(convert.ConvertError, match=message.replace("(", r"\(").replace("[", r"\[")):
        convert.model_config_from_hf(hf)


def test_rope_scaling_and_rope_parameters_that_disagree_are_refused():
    """hetjax's export writes both; with rope_scaling edited, transformers read it and hetjax
    read the stale rope_parameters: logits 0.09 apart, without a word."""
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf = transformers.LlamaConfig(**SHAPE, rope_parameters=llama3).to_dict()
    old_style = {"type": "llama3", **{k: v for k, v in llama3.items() if k not in ("rope_type", "rope_theta")}}
    for scaling in (None, old_style, dict(llama3)):  # absent, the older spelling, the same
        m = convert.model_config_from_hf(dict(hf, rope_parameters=llama3, rope_scaling=scaling, rope_theta=5e5))
        assert (m.rope_scaling_factor, m.rope_theta) == (8.0, 5e5)
    m = convert.model_config_from_hf(dict(hf, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                                          rope_scaling=old_style))
    assert m.rope_scaling_factor == 8.0  # rope_scaling's, as transformers reads it
    with pytest.raises(convert.ConvertError, match=r"rope_scaling=.*'factor': 32.0.* and rope_parameters=.* disagree; "
                                                   r"transformers reads rope_scaling"):
        convert.model_config_from_hf(dict(hf, rope_parameters=llama3, rope_scaling=dict(old_style, factor=32.0)))


@pytest.mark.parametrize("field, value, message", [
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0},
     "llama3 RoPE needs factor, low_freq_factor, high_freq_factor, original_max_position_embeddings; low_freq_factor"),
    ("num_key_value_heads", 3, "num_heads=4 is not a multiple of config.model.num_kv_heads=3"),
])
def test_bad_hf_configs_and_files_are_refused_with_their_field_not_a_traceback(tmp_path, capsys, field, value, message):
    """A llama3 RoPE with a key missing was a KeyError, heads that do not group were imported
    and refused only by training, and a truncated shard was a ValueError's traceback."""
    hf_model("llama", tmp_path / "hf")
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    hf[field] = value
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps(hf))
    for f in (tmp_path / "hf").glob("*.safetensors"):
        shutil.copy(f, tmp_path / "bad")
    assert convert.main(["import", str(tmp_path / "bad"), str(tmp_path / "o1")]) == 2
    assert message in capsys.readouterr().err
    shard = sorted((tmp_path / "hf").glob("*.safetensors"))[-1]
    whole = shard.read_bytes()
    shard.write_bytes(whole[:-100])
    assert convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "o2")]) == 2
    assert "is truncated inside tensor" in capsys.readouterr().err
    shard.write_bytes(whole)
    # Each of these was a traceback (MemoryError, struct.error, KeyError), or a silent import.
    index = json.loads((tmp_path / "hf" / safetensors_io.INDEX).read_text())["weight_map"]
    name = next(n for n in index if n.endswith("up_proj.weight"))
    shard = tmp_path / "hf" / index[name]
    whole = shard.read_bytes()
    header = json.loads(whole[8:8 + int.from_bytes(whole[:8], "little")])
    int8 = dict(header, **{name: dict(header[name], dtype="I8", data_offsets=[
        header[name]["data_offsets"][0], header[name]["data_offsets"][0] + math.prod(header[name]["shape"])])})
    text = json.dumps(int8).encode()
    for damaged, said in ((b"version https://git-lfs.github.com/spec/v1\noid sha256:0\n", "is a Git LFS pointer"),
                          (b"\x05", "is not a safetensors file"), (len(text).to_bytes(8, "little") + text + whole[8 + int.from_bytes(whole[:8], "little"):],
                                                                     f"{name} has dtype I8: hetjax imports floating-point")):
        shard.write_bytes(damaged)
        assert convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "o3")]) == 2
        assert said in capsys.readouterr().err
    assert convert.main(["export", str(tmp_path / "x"), str(tmp_path / "o4"), "--max_shard_gb", "nan"]) == 2
    assert "--max_shard_gb=nan: give the largest shard in GB" in capsys.readouterr().err


def test_a_tied_checkpoint_storing_its_head_too_and_an_index_naming_the_wrong_shard(tmp_path, capsys):
    """A tied Qwen2 checkpoint that also stores lm_head.weight (transformers loads it) was
    refused as "tensors ['lm_head.weight'] have no place"; an index whose weight_map names
    the wrong shard was a KeyError's traceback."""
    from safetensors.numpy import load_file, save_file
    hf_model("qwen2", tmp_path / "hf")
    weights = next((tmp_path / "hf").glob("*.safetensors"))
    tensors = load_file(weights)
    embed = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embed.copy()}, weights)
    assert convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "o1")]) == 0
    save_file({**tensors, "lm_head.weight": embed + 1}, weights)
    assert convert.main(["import", str(tmp_path / "hf"), str(tmp_path / "o2")]) == 2
    assert "tie_word_embeddings=True, but lm_head.weight is not the embedding" in capsys.readouterr().err
    hf_model("llama", tmp_path / "sharded")
    index_file = tmp_path / "sharded" / safetensors_io.INDEX
    index = json.loads(index_file.read_text())
    name = next(n for n in index["weight_map"] if n.endswith("up_proj.weight"))
    index["weight_map"][name] = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    index_file.write_text(json.dumps(index))
    assert convert.main(["import", str(tmp_path / "sharded"), str(tmp_path / "o3")]) == 2
    assert f"holds no tensor {name}, which {safetensors_io.INDEX} places there" in capsys.readouterr().err
