"""Ahead-of-time export: artifacts for other platforms, the manifest, refusals, and
the cpu artifact running bit for bit like the jitted step."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax import data, program, step
from hetjax.compile import cli, export
from hetjax.compile.__main__ import main as compile_main
from hetjax.config import Config, ConfigError, MeshConfig, ModelConfig, OptimConfig, to_dict
from hetjax.mesh import make_mesh
from hetjax.optim import learning_rate_schedule

CFG = Config(
    model=ModelConfig(vocab_size=64, num_layers=2, embed_dim=32, mlp_dim=64, num_heads=4,
                      num_kv_heads=2, head_dim=8),
    mesh=MeshConfig(data=2, fsdp=4, tensor=1),
    optim=OptimConfig(learning_rate=1e-2, warmup_steps=1),
    batch_size=8, seq_len=16, steps=3)


def test_export_for_gpus_writes_a_manifest_that_round_trips(tmp_path):
    mesh = make_mesh(CFG.mesh)
    manifest = export.export(CFG, mesh, ("cuda", "rocm"), tmp_path)
    assert export.read_manifest(tmp_path) == json.loads(json.dumps(manifest))
    assert manifest["platforms"] == ["cuda", "rocm"] and manifest["jax_version"] == jax.__version__
    assert manifest["mesh"]["shape"] == {"pipeline": 1, "data": 2, "fsdp": 4, "tensor": 1}
    # Inputs: every state leaf then the batch, with the shapes the config implies.
    prog = program.build(CFG, mesh)
    leaves = jax.tree.leaves(prog.state)
    train = manifest["functions"]["train_step"]
    assert len(train["inputs"]) == len(leaves) + len(step.BATCH_KEYS)
    for record, leaf in zip(train["inputs"], leaves):
        assert tuple(record["shape"]) == leaf.shape and record["dtype"] == str(leaf.dtype)
    embed = next(r for r in train["inputs"] if r["path"].startswith(".params['embed_VD']"))
    assert embed["spec"] == "('tensor', 'fsdp')"  # (vocab, embed) by the default rules
    assert train["inputs"][-1]["spec"] == "(('data', 'fsdp'), None)"  # the batch
    assert [r["path"] for r in train["inputs"][-5:]] == [f"batch[{k!r}]" for k in sorted(step.BATCH_KEYS)]
    assert [r["path"] for r in manifest["functions"]["eval_step"]["outputs"]] == ["['loss_sum']", "['tokens']"]
    assert {r["shape"] == [8, 16] for r in train["inputs"][-5:]} == {True}
    # This CPU process may not run a cuda/rocm artifact.
    with pytest.raises(export.ArtifactMismatch, match=r"for platforms \['cuda', 'rocm'\].*on 'cpu'"):
        export.load(tmp_path, CFG, mesh)


def test_cpu_artifact_matches_the_jitted_step_bit_for_bit(tmp_path):
    """In a child compiled with XLA:CPU's own fusion emitters, as a user's run is. With the
    suite's faster elemental ones (tests/conftest.py) the artifact's program and the jitted
    one fuse differently and their gradients differ in the last bits (747 of 1024)."""
    flags = " ".join(f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_cpu_use_fusion_emitters"))
    child = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=str(Path(__file__).parent.parent)))
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    assert child.stdout.splitlines()[-1] == "the cpu artifact ran 2 steps bit for bit like the jitted step"


def artifact_matches_the_jitted_step(tmp_path):
    mesh = make_mesh(CFG.mesh)
    export.export(CFG, mesh, ("cpu", "cuda", "rocm"), tmp_path)
    loaded = export.load(tmp_path, CFG, mesh)
    prog = program.build(CFG, mesh)
    fn = step.make_train_step(prog.graphdef, prog.tx, learning_rate_schedule(CFG.optim, CFG.steps),
                              mesh, CFG.sharding.rules)
    jitted = program.jit_train_step(fn, prog.state_shardings, prog.batch_shardings, mesh)
    eval_jitted = program.jit_eval_step(step.make_eval_step(prog.graphdef, mesh, CFG.sharding.rules),
                                        prog.state_shardings.params, prog.batch_shardings, mesh)
    ours = prog.init_state()
    # Two copies (both steps donate their state), made by one program.
    theirs = jax.jit(lambda t: jax.tree.map(jnp.copy, t))(ours)
    dataset = data.build(CFG)
    for s in range(2):
        batch = dataset.batch(s, prog.batch_shardings)
        ours, m_ours = loaded.train_step(ours, batch)
        theirs, m_theirs = jitted(theirs, batch)
        for a, b in zip(jax.tree.leaves((ours, m_ours)), jax.tree.leaves((theirs, m_theirs)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(ours.step) == 2
    assert ours.params["embed_VD"].sharding.is_equivalent_to(theirs.params["embed_VD"].sharding, 2)
    e1, e2 = loaded.eval_step(ours.params, batch), eval_jitted(theirs.params, batch)
    assert float(e1["loss_sum"]) == float(e2["loss_sum"]) and float(e1["tokens"]) == float(e2["tokens"])
    print("the cpu artifact ran 2 steps bit for bit like the jitted step")


def test_loading_refuses_other_meshes_jax_versions_configs_and_corruption(tmp_path):
    mesh = make_mesh(CFG.mesh)
    export.export(CFG, mesh, ("cpu",), tmp_path)
    other_mesh = make_mesh(MeshConfig(data=4, fsdp=2, tensor=1))
    with pytest.raises(export.ArtifactMismatch, match=r"mesh pipeline=1,data=2,fsdp=4,tensor=1.*"
                                                      r"data=4,fsdp=2,tensor=1"):
        export.load(tmp_path, CFG, other_mesh)
    changed = dataclasses.replace(CFG, optim=dataclasses.replace(CFG.optim, learning_rate=0.5))
    with pytest.raises(export.ArtifactMismatch, match=r"config\.optim\.learning_rate"):
        export.load(tmp_path, changed, mesh)
    once = dataclasses.replace(CFG, sharding=dataclasses.replace(CFG.sharding, grad_sync="once"))
    with pytest.raises(export.ArtifactMismatch, match=r"config\.sharding\.grad_sync"):  # another program
        export.load(tmp_path, once, mesh)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    # What the program does not depend on may change (it was refused): paths, logging,
    # checkpoints, the seed, the cache, and a config.mesh that resolves to the same mesh.
    same = dataclasses.replace(CFG, run_dir="runs/other", log_every=5, seed=7, mesh=MeshConfig(data=2, fsdp=-1),
                               checkpoint=dataclasses.replace(CFG.checkpoint, every=3),
                               compile=dataclasses.replace(CFG.compile, cache=False))
    export.check(manifest, same, make_mesh(same.mesh))
    # virtual_stages=0 (automatic) is 1 without a pipeline: the manifest records what ran,
    # and an explicit 1 is the same program.
    assert CFG.pipeline.virtual_stages == 0 and manifest["config"]["pipeline"]["virtual_stages"] == 1
    for v in (0, 1):
        export.check(manifest, dataclasses.replace(CFG, pipeline=dataclasses.replace(CFG.pipeline, virtual_stages=v)),
                     mesh)
    # config.steps ends the learning rate's cosine unless config.optim.decay_steps does.
    with pytest.raises(export.ArtifactMismatch, match=r"fields that differ: config\.optim\.decay_steps\)"):
        export.check(manifest, dataclasses.replace(CFG, steps=4), mesh)
    ends_at_steps = dataclasses.replace(CFG, optim=dataclasses.replace(CFG.optim, decay_steps=CFG.steps))
    export.check(manifest, ends_at_steps, mesh)  # the same schedule, said the other way
    decayed = dataclasses.replace(CFG, optim=dataclasses.replace(CFG.optim, decay_steps=3))
    assert export.program_fields(to_dict(decayed)) == export.program_fields(to_dict(
        dataclasses.replace(decayed, steps=4)))
    (tmp_path / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "functions"}))
    with pytest.raises(export.ArtifactMismatch, match=r"manifest has no functions entry; export again"):
        export.load(tmp_path, CFG, mesh)
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "functions": {
        "train_step": manifest["functions"]["train_step"]}}))
    with pytest.raises(export.ArtifactMismatch, match=r"manifest has no functions\.eval_step entry"):
        export.load(tmp_path, CFG, mesh)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    eval_blob = (tmp_path / "eval_step.jax").read_bytes()
    (tmp_path / "eval_step.jax").unlink()
    with pytest.raises(export.ArtifactMismatch, match=r"eval_step\.jax: the manifest lists it for eval_step, but "
                                                      r"it cannot be read .*export again"):
        export.load(tmp_path, CFG, mesh)
    (tmp_path / "eval_step.jax").write_bytes(eval_blob)
    (tmp_path / "manifest.json").write_text(json.dumps({**manifest, "jax_version": "0.9.0"}))
    with pytest.raises(export.ArtifactMismatch, match=r"jax 0\.9\.0, but this is jax"):
        export.load(tmp_path, CFG, mesh)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    blob = bytearray((tmp_path / "train_step.jax").read_bytes())
    blob[len(blob) // 2] ^= 1
    (tmp_path / "train_step.jax").write_bytes(bytes(blob))
    with pytest.raises(export.ArtifactMismatch, match="sha256"):
        export.load(tmp_path, CFG, mesh)
    text = json.dumps(manifest)
    (tmp_path / "manifest.json").write_text(text[:len(text) // 2])  # cut short (a full disk)
    with pytest.raises(export.ArtifactMismatch, match="unreadable manifest"):
        export.load(tmp_path, CFG, mesh)


def test_command_line_bad_input(tmp_path, capsys):
    run = lambda *a: cli.run(compile_main, ["--config", "tiny", "--out", str(tmp_path), *a])  # noqa: E731
    assert run("--platforms", "cuda,tpu", "--devices", "8") == 2
    assert "--platforms='tpu'" in capsys.readouterr().err
    assert run("--platforms", "cuda") == 2
    assert "give --devices N" in capsys.readouterr().err
    assert run("--platforms", "cuda", "--devices", "8", "--config.mesh.data=3") == 2
    assert "does not divide the 8 devices" in capsys.readouterr().err
    assert run("--platforms", "rocm", "--devices", "8", "--config.mesh.tensor=8") == 2
    assert "config.model.num_heads=4 does not split over config.mesh.tensor=8" in capsys.readouterr().err
    assert cli.run(compile_main, ["--config", "tiny_hetero", "--out", str(tmp_path), "--platforms", "cuda,rocm",
                                  "--devices", "4"]) == 2
    assert "config.hetero.islands (cuda, rocm): python -m hetjax.compile works on one mesh" in capsys.readouterr().err
    assert run("--platforms", "cuda,rocm,cuda", "--devices", "8") == 2  # a typo for a platform left out?
    assert "--platforms=cuda,rocm,cuda names cuda twice; give each platform once" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything was written
    assert run("--platforms", "cuda,rocm", "--devices", "8", "--config.model.num_layers=1") == 0
    assert "train_step of tiny for cuda,rocm" in capsys.readouterr().out
    assert export.read_manifest(tmp_path)["config"]["model"]["num_layers"] == 1
    with pytest.raises(ConfigError, match="--devices=0"):
        cli.device_count(CFG, 0)


if __name__ == "__main__":  # the child of test_cpu_artifact_matches_the_jitted_step_bit_for_bit
    artifact_matches_the_jitted_step(Path(sys.argv[1]))


def test_an_artifact_records_the_chunks_its_pipeline_runs(tmp_path):
    """virtual_stages=0 (automatic) goes into the manifest as what the mesh makes of it: 2
    chunks per stage on the 2 stages that config.mesh.pipeline=-1 counts on 2 devices. An
    explicit 2 is the same program; the uninterleaved one (1) is another."""
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, num_layers=4),
                              mesh=MeshConfig(pipeline=-1, fsdp=1))
    mesh = make_mesh(cfg.mesh, jax.devices()[:2])
    assert cfg.pipeline.virtual_stages == 0 and mesh.shape["pipeline"] == 2
    manifest = export.export(cfg, mesh, ("cpu",), tmp_path)
    assert manifest["config"]["pipeline"]["virtual_stages"] == 2

    def given(v):
        return dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, virtual_stages=v))
    export.check(manifest, cfg, mesh)
    export.check(manifest, given(2), mesh)
    with pytest.raises(export.ArtifactMismatch, match=r"fields that differ: config\.pipeline\.virtual_stages\)"):
        export.check(manifest, given(1), mesh)
