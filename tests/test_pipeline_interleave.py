"""Interleaved (circular) stages across islands: each virtual island holds V = 2
non-contiguous chunks of layers, a micro-batch goes round the islands twice, and the
job trains like the unpipelined model; its checkpoints go to the model's layout and
back with identical parameters."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax import repro, train
from hetjax.config import ConfigError, load, validate
from hetjax.hetero import checkpoints as ckpt_lib
from hetjax.hetero import island as island_lib
from hetjax.pipeline import make_schedule
from hetjax.pipeline.stages import add_chunk, chunk_of
from tests.test_hetero import tiny_islands, write_config

STEPS = 3
ISLANDS_V2 = '''
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=4, tie_embeddings=True))
    islands = (IslandConfig(name="a", devices_per_process=2, mesh=MeshConfig(fsdp=2)),
               IslandConfig(name="b", devices_per_process=1, mesh=MeshConfig(fsdp=1)))
    return dataclasses.replace(cfg, hetero=HeteroConfig(islands=islands),
                               pipeline=PipelineConfig(schedule="1f1b_fused", microbatches=4, virtual_stages=2))
'''
ONE = ["--config.model.num_layers=4", "--config.model.tie_embeddings=True"]


def run(tmp_path, config, name, *overrides, steps=STEPS):
    run_dir = tmp_path / name
    assert train.main(["--config", str(config), f"--config.run_dir={run_dir}", f"--config.steps={steps}",
                       "--config.eval_every=0", "--config.tensorboard=False",
                       "--config.checkpoint.async_save=False", *overrides]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, run_dir


def test_interleaved_islands_train_like_one_island_and_checkpoint_to_its_layout_and_back(tmp_path, capsys):
    config = write_config(tmp_path, "islands", ISLANDS_V2)
    cfg = load(str(config))
    islands, run_dir = run(tmp_path, config, "islands", "--config.checkpoint.every=2")
    one, one_dir = run(tmp_path, "tiny.py", "one", *ONE)
    assert sorted(islands) == sorted(one) == list(range(STEPS))
    np.testing.assert_allclose([islands[s] for s in range(STEPS)], [one[s] for s in range(STEPS)], rtol=1e-5)
    # Each chunk's backward split in two (and recomputing its forward) trains the same.
    split, _ = run(tmp_path, config, "split", "--config.pipeline.split_backward=True",
                   "--config.pipeline.recompute=True")
    np.testing.assert_allclose([split[s] for s in range(STEPS)], [one[s] for s in range(STEPS)], rtol=1e-5)

    # Island a holds model layers 0 and 2, island b 1 and 3 (chunks of one layer each).
    assert [island_lib.chunks_of(cfg, k, None) for k in range(2)] == [((0, 1), (2, 3)), ((1, 2), (3, 4))]
    # The newest step, put together, has the digest that the islands recorded of their parts.
    newest, last = ckpt_lib.model_params(cfg, run_dir / "checkpoints", log=lambda _: None)
    recorded = [json.loads(line) for line in (run_dir / "fingerprints.jsonl").read_text().splitlines()]
    assert newest == STEPS
    assert repro.digest.hex64(repro.param_fingerprint(last).digest) == next(
        r["params"] for r in recorded if r.get("kind") == "params" and r["step"] == STEPS)
    step, params = ckpt_lib.model_params(cfg, run_dir / "checkpoints", 2, log=lambda _: None)
    # To the model's layout (as the command writes it): an unpipelined run started from it
    # computes the islands' step-2 loss on batch 2 (layers in another order would not).
    assert ckpt_lib.main(["--config", str(config), f"--checkpoints={run_dir}/checkpoints",
                          f"--out={tmp_path}/model", "--step=2"]) == 0
    resumed, _ = run(tmp_path, "tiny.py", "from_islands", *ONE, f"--config.init_from={tmp_path}/model/2",
                     "--config.data.start_step=2")
    np.testing.assert_allclose(resumed[2], islands[2], rtol=1e-5)
    # The optimizer state comes along: a one-mesh run resumes from the converted step 2
    # (its data position too) ...
    resumed, _ = run(tmp_path, "tiny.py", "resumed", *ONE, f"--config.checkpoint.dir={tmp_path}/model")
    assert list(resumed) == [2]
    np.testing.assert_allclose(resumed[2], islands[2], rtol=1e-5)
    # ... and the islands' Adam moments, put together, are those of the same model trained on one mesh.
    newest, state, _ = ckpt_lib.model_state(cfg, run_dir / "checkpoints", log=lambda _: None)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    manager = ckpt_lib.checkpoint.Manager(one_dir / "checkpoints", read_only=True)
    _, theirs = manager.read(newest, {"opt_state": (state.opt_state, jax.tree.map(lambda _: cpu, state.opt_state)),
                                      "params": (state.params, jax.tree.map(lambda _: cpu, state.params))})
    manager.close()
    for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(theirs.opt_state), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=1e-9)
    # And back: each island's part of the model-layout parameters is, bit for bit, what it saved.
    for k, spec in enumerate(cfg.hetero.islands):
        mine = island_lib.part(params, k, 2, island_lib.chunks_of(cfg, k, None), True)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        manager = ckpt_lib.checkpoint.Manager(run_dir / "checkpoints" / spec.name, read_only=True)
        saved = manager.read(2, {"params": (jax.eval_shape(lambda: mine), jax.tree.map(lambda _: device, mine))})
        manager.close()
        for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(saved[1].params), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))

    # Another layer placement holds other layers in parts of the same shapes: refused, naming
    # the field, by the converter and by a resumed run (before it compiles anything).
    refused = "config.pipeline.virtual_stages=2 but this config has 1"
    with pytest.raises(ConfigError, match=refused):
        ckpt_lib.model_params(load(str(config), {"pipeline.virtual_stages": "1", "pipeline.schedule": "gpipe"}),
                              run_dir / "checkpoints")
    capsys.readouterr()
    with pytest.raises(ConfigError, match=refused):
        train.main(["--config", str(config), f"--config.run_dir={run_dir}", "--config.tensorboard=False",
                    "--config.pipeline.virtual_stages=1", "--config.pipeline.schedule=gpipe"])
    assert "island a (" not in capsys.readouterr().out  # no island was built (it would say so)
    assert ckpt_lib.main(["--config", str(config), f"--checkpoints={run_dir}/checkpoints", f"--out={tmp_path}/x",
                          "--step=abc"]) == 2
    assert "--step='abc'" in capsys.readouterr().err


def test_an_island_runs_each_chunk_after_its_input_arrived():
    # Read per island without lockstep: each (micro-batch, virtual stage j = v*n + k) runs
    # forward and backward once, and in every island's order an operation comes after the
    # operations on other islands that it waits for (no cycle: each is in an earlier tick).
    for kind in ("gpipe", "1f1b_fused"):
        for n, M in ((2, 4), (3, 6), (2, 3)):
            sched = make_schedule(kind, n, M, 2)
            J, tick = 2 * n, {}  # read from the tables, independently of ops()
            for name, table, chunks in (("F", sched.forward, sched.forward_chunk),
                                        ("B", sched.backward, sched.backward_chunk)):
                for t, k in zip(*np.nonzero(table >= 0)):
                    tick[name, int(table[t, k]), int(chunks[t, k]) * n + int(k)] = int(t)
            assert len(tick) == 2 * M * J
            for k in range(n):
                ops = sched.ops(k)
                assert sorted(ops) == sorted((op, m, v) for op in "FB" for m in range(M) for v in range(2))
                at = [(tick[op, m, v * n + k], op == "B") for op, m, v in ops]
                assert at == sorted(at)  # in tick order, a tick's forward first
            for m in range(M):
                for j in range(1, J):
                    assert tick["F", m, j] > tick["F", m, j - 1] and tick["B", m, j - 1] > tick["B", m, j]
                assert tick["B", m, J - 1] >= tick["F", m, J - 1]


def test_a_chunk_of_the_parameters_and_its_gradient_land_on_its_layers():
    params = {"blocks": {"w": np.arange(12.0).reshape(4, 3)}, "embed_VD": np.ones((2, 2))}
    got = chunk_of(params, 1, 2)
    np.testing.assert_array_equal(got["blocks"]["w"], params["blocks"]["w"][2:4])
    assert got["embed_VD"] is params["embed_VD"]
    grads = {"blocks": {"w": np.ones((2, 3))}, "embed_VD": np.ones((2, 2))}
    acc = add_chunk(jax.tree.map(jnp.zeros_like, params), grads, 1, 2)
    np.testing.assert_array_equal(acc["blocks"]["w"], [[0] * 3] * 2 + [[1] * 3] * 2)
    np.testing.assert_array_equal(acc["embed_VD"], np.ones((2, 2)))


@pytest.mark.parametrize("overrides, match", [
    ({"pipeline.virtual_stages": "2", "pipeline.schedule": "1f1b_fused"},  # tiny: 2 layers, not 2 x 2
     "virtual_stages=2 with config.hetero.placement='pipeline': .* multiple of 4"),
    ({"pipeline.virtual_stages": "2", "pipeline.schedule": "1f1b", "model.num_layers": "4"},
     "virtual_stages=2 with config.pipeline.schedule='1f1b': interleaved stages run with gpipe or 1f1b_fused"),
])
def test_interleaved_islands_refuse_what_they_cannot_run(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(tiny_islands(overrides))
    with pytest.raises(ConfigError, match="island_layers / auto_split"):
        validate(tiny_islands({"pipeline.virtual_stages": "2", "pipeline.schedule": "gpipe",
                               "model.num_layers": "4"}, island_layers=(2, 2)))
