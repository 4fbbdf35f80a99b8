"""Islands (hetjax/hetero) in virtual mode: a job split over islands trains exactly
like the same job on one island (losses within 1e-5 relative), and data-parallel
islands hold bitwise-identical parameters."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from hetjax import checkpoint, train
from hetjax.config import (ConfigError, HeteroConfig, IslandConfig, LinkConfig, MeshConfig, load,
                           validate)
from hetjax.hetero import job as job_lib
from hetjax.hetero import placement
from hetjax.hetero.links import IslandLost, Links
from hetjax.repro.check import cpu_env

STEPS = 10
ROOT = Path(__file__).resolve().parent.parent


def write_config(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent('''
        import dataclasses
        from hetjax.config import *
        from hetjax.configs import tiny

        def get_config():
            cfg = tiny.get_config()
    ''') + textwrap.indent(textwrap.dedent(body), "    "))
    return path


def losses(tmp_path, config, run, *overrides):
    run_dir = tmp_path / run
    code = train.main(["--config", str(config), f"--config.run_dir={run_dir}", f"--config.steps={STEPS}",
                       "--config.eval_every=0", "--config.log_every=100", "--config.tensorboard=False",
                       "--config.checkpoint.async_save=False", *overrides])
    assert code == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # each step's own time: none a few microseconds of dispatch (1e-4 s against medians of
    # 0.02-0.2 s); under CI's load single steps swing 4x either way (0.034 s against 0.135),
    # and more beside other jobs (a step under 5% of the median was seen once)
    times = [r["step_time"] for r in rows if "step_time" in r]
    assert min(times) > 0.01 * np.median(times) and max(r["mfu"] for r in rows if "mfu" in r) < 1, times
    return np.array([r["loss"] for r in rows if "loss" in r]), run_dir


def assert_close(got, want):
    assert got.shape == want.shape == (STEPS,)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    assert want[-1] < want[0]  # it trained


def test_pipeline_islands_train_like_one_island(tmp_path):
    # The default schedule (1F1B fused) over two islands with three layers split 2 + 1,
    # tensor parallelism inside the first island and tied embeddings (the first and the
    # last island both hold the embedding and add its gradients).
    config = write_config(tmp_path, "islands", '''
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=3, tie_embeddings=True))
        islands = (IslandConfig(name="cuda", platform="cuda", devices_per_process=2,
                                mesh=MeshConfig(fsdp=1, tensor=2), speed=2.0),
                   IslandConfig(name="rocm", platform="rocm", devices_per_process=2, mesh=MeshConfig(fsdp=2)))
        return dataclasses.replace(cfg, hetero=HeteroConfig(islands=islands), pipeline=PipelineConfig(microbatches=4))
    ''')
    assert placement.island_layers(load(str(config))) == (2, 1)
    assert load(str(config)).pipeline.schedule == "1f1b_fused"
    islands, _ = losses(tmp_path, config, "islands")
    one, _ = losses(tmp_path, "tiny.py", "one", "--config.mesh.pipeline=2", "--config.pipeline.schedule=1f1b",
                    "--config.pipeline.stage_layers=(2,1)", "--config.model.num_layers=3",
                    "--config.model.tie_embeddings=True")
    assert_close(islands, one)
    # The first island keeps its forwards' residuals by default; recomputing them trains the same.
    recomputed, _ = losses(tmp_path, config, "recomputed", "--config.pipeline.recompute=True")
    assert_close(recomputed, one)
    # Backwards split into their input- and weight-gradient parts (zero-bubble style): the same.
    split, _ = losses(tmp_path, config, "split", "--config.pipeline.split_backward=True")
    assert_close(split, one)


DATA_CASES = {
    # Island cuda sums its data shards' gradients once a step (config.sharding.grad_sync).
    "even": ('''
        islands = (IslandConfig(name="cuda", devices_per_process=2, mesh=MeshConfig(data=2, fsdp=1)),
                   IslandConfig(name="rocm", devices_per_process=2, mesh=MeshConfig(fsdp=2)))
        return dataclasses.replace(cfg, hetero=HeteroConfig(islands=islands, placement="data",
                                                            fingerprint_every=3),
                                   sharding=dataclasses.replace(cfg.sharding, grad_sync="once"))
    ''', (8, 8)),
    # 1:3 speeds; the faster island runs its own two-stage pipeline inside.
    "uneven-pipeline-inside": ('''
        islands = (IslandConfig(name="cuda", devices_per_process=2, mesh=MeshConfig(fsdp=2), speed=1.0),
                   IslandConfig(name="rocm", devices_per_process=2, mesh=MeshConfig(pipeline=2, fsdp=1), speed=3.0))
        return dataclasses.replace(cfg, hetero=HeteroConfig(islands=islands, placement="data",
                                                            fingerprint_every=3),
                                   pipeline=PipelineConfig(schedule="1f1b", microbatches=2))
    ''', (4, 12)),
}


@pytest.fixture(scope="module")
def one_island_data_parallel(tmp_path_factory):
    return losses(tmp_path_factory.mktemp("one"), "tiny.py", "one", "--config.mesh.data=8",
                  "--config.mesh.fsdp=1")[0]


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_data_islands_train_like_one_island_with_identical_parameters(tmp_path, case, one_island_data_parallel):
    body, shares = DATA_CASES[case]
    config = write_config(tmp_path, "islands", body)
    cfg = load(str(config))
    assert tuple(n for _, n in placement.batch_shares(cfg)) == shares
    islands, run_dir = losses(tmp_path, config, "islands")
    assert_close(islands, one_island_data_parallel)
    prints = set()
    for name in ("cuda", "rocm"):
        manager = checkpoint.Manager(run_dir / "checkpoints" / name)
        prints.add(manager.read_json(STEPS, "meta").meta["params_checksum"])
        manager.close()
    assert len(prints) == 1  # bit for bit the same parameters on both islands
    if case == "even":
        # To one mesh, optimizer state included (the converter refused data placement, and
        # its advice, to resume island 0's checkpoint, failed on the optimizer state's structure).
        from hetjax.hetero import checkpoints as ckpt_lib
        assert ckpt_lib.main(["--config", str(config), f"--checkpoints={run_dir}/checkpoints",
                              f"--out={tmp_path}/model"]) == 0
        manager = checkpoint.Manager(tmp_path / "model", read_only=True)
        assert {manager.read_json(STEPS, "meta").meta["params_checksum"]} == prints
        manager.close()
        resumed, _ = losses(tmp_path, "tiny.py", "resumed", "--config.mesh.data=8", "--config.mesh.fsdp=1",
                            f"--config.checkpoint.dir={tmp_path}/model", f"--config.steps={STEPS + 1}")
        assert resumed.shape == (1,) and resumed[0] < islands[0]  # step STEPS, after the islands' ten
        with pytest.raises(ConfigError, match="written by an island of an islands job.*export it first"):
            train.main(["--config", "tiny.py", "--config.mesh.data=8", "--config.mesh.fsdp=1",
                        f"--config.run_dir={tmp_path}/direct", f"--config.checkpoint.dir={run_dir}/checkpoints/cuda"])


def test_islands_whose_parameters_differ_are_stopped_at_the_next_check(tmp_path):
    """The identical-parameters check of data placement is read one call after it starts
    (so that no island waits between steps), before any checkpoint is saved, and at once
    on the last step."""
    from hetjax import data
    from hetjax.errors import IslandsDiverged
    cfg = load(str(write_config(tmp_path, "islands", DATA_CASES["even"][0])),
               {"steps": "6", "run_dir": str(tmp_path / "run")})

    def diverged(states):  # island rocm's first tensor one ulp off
        bad = list(states)
        leaves, treedef = jax.tree.flatten(bad[1].params)
        leaves[0] = jax.numpy.nextafter(leaves[0], jax.numpy.inf)
        bad[1] = dataclasses.replace(bad[1], params=jax.tree.unflatten(treedef, leaves))
        return bad

    started = r"fingerprint3: island rocm holds different parameters than island cuda \(1 of \d+ tensors differ"
    for case in ("next call", "save", "last step"):  # a fresh job each: a failed check closes its links
        job = job_lib.IslandsJob(cfg, data.build(cfg), log=lambda line: None)
        try:
            job.check_identical(job.state, 1)  # compared already at the start: the islands begin alike
            bad = diverged(job.state)
            if case == "last step":
                with pytest.raises(IslandsDiverged, match=r"fingerprint6: "):
                    job.check_identical(bad, 6)  # read at once
                continue
            job.check_identical(bad, 3)  # due (fingerprint_every=3): started, not read yet
            with pytest.raises(IslandsDiverged, match=started):
                if case == "next call":
                    job.check_identical(bad, 4)
                else:  # read before a checkpoint is saved: none is written
                    job.checkpoints.save(3, bad, job.batches.get_state(), {})
            assert job.checkpoints.steps() == []
        finally:
            job.close()


def test_placement_splits_in_proportion_to_speed():
    assert placement.proportional(8, [1, 1]) == (4, 4)
    assert placement.proportional(32, [1, 3]) == (8, 24)
    assert placement.proportional(5, [1, 100]) == (1, 4)  # every island keeps at least one
    assert placement.proportional(16, [1, 1], units=[2, 4]) == (8, 8)
    assert placement.proportional(16, [1, 2.9], units=[2, 4]) == (4, 12)
    with pytest.raises(ConfigError, match="cannot be split"):
        placement.proportional(6, [1, 1], units=[4, 4])
    # The greedy hand-out reaches (8, 15) and 1 row left over; (6, 18) fits and is nearest.
    assert placement.proportional(24, [1, 2], units=[2, 3]) == (6, 18)
    for total in range(1, 40):  # a split is found exactly when one exists
        for units in ([2, 3], [3, 6], [6, 3], [2, 2], [3, 3]):
            exists = any(a * units[0] + b * units[1] == total for a in range(1, 40) for b in range(1, 40))
            try:
                parts = placement.proportional(total, [1, 2], units)
            except ConfigError:
                parts = None
            assert (parts is not None) == exists, (total, units)
            assert parts is None or (sum(parts) == total and all(p % u == 0 and p > 0 for p, u in zip(parts, units)))


def test_placement_takes_the_closest_split_when_the_greedy_one_is_merely_poor():
    # The hand-out stopped once the rest (here 3 rows, then 7) was below the fast island's
    # unit, and settled for a split that added up but was not the closest.
    assert placement.proportional(16, [1, 2], units=[1, 4]) == (4, 12)  # was (8, 8); ideal 5.3 + 10.7
    assert placement.proportional(39, [3, 1, 3], units=[8, 8, 1]) == (16, 8, 15)  # was (8, 8, 23)
    # Equally close splits keep the hand-out's (the shipped configs' splits stay as they were).
    assert placement.proportional(5, [1, 1]) == (3, 2)  # not the search's first, (2, 3)


@pytest.mark.parametrize("hetero, where", [
    ({"link": LinkConfig(backend="host", nic_addresses=("10.0.0.1", "10.0.1.1"))}, "config.hetero.link"),
    ({"links": (LinkConfig(backend="host", nic_addresses=("10.0.0.1",)),)}, "config.hetero.links\\[0\\]"),
])
def test_nic_addresses_are_refused_for_islands_in_processes(hetero, where):
    """Peers dial the address a process's host name resolves to, never its NICs: an island
    listening on its NICs alone was reported lost (IslandLost ... Connection refused)."""
    with pytest.raises(ConfigError, match=f"{where}.nic_addresses=\\(.*\\) with config.hetero.virtual=False: "
                                          f".*leave {where}.nic_addresses unset for islands"):
        validate(tiny_islands(virtual=False, **hetero))
    validate(tiny_islands(virtual=False, link=LinkConfig(backend="host")))
    validate(tiny_islands(link=LinkConfig(backend="local", nic_addresses=("10.0.0.1",))))  # virtual: not used


def tiny_islands(overrides=(), **hetero):
    cfg = load("tiny.py", dict(overrides))
    islands = (IslandConfig(name="a", devices_per_process=2, mesh=MeshConfig(fsdp=2)),
               IslandConfig(name="b", devices_per_process=2, mesh=MeshConfig(fsdp=2)))
    return cfg.__class__(**{**cfg.__dict__, "hetero": HeteroConfig(**{"islands": islands, **hetero})})


@pytest.mark.parametrize("hetero, match", [
    ({"placement": "ring"}, "placement='ring'"),
    ({"island_layers": (2, 1)}, "island_layers=\\(2, 1\\)"),
    ({"link": LinkConfig(backend="host")}, "virtual islands share one process"),
    ({"islands": (IslandConfig(name="a", devices_per_process=2, mesh=MeshConfig(fsdp=4)),
                  IslandConfig(name="b"))}, "islands\\[0\\].mesh"),
    ({"islands": (IslandConfig(name="a"), IslandConfig(name="a"))}, "used twice"),
    ({"islands": (IslandConfig(name="a", mesh=MeshConfig(pipeline=1)),
                  IslandConfig(name="b", devices_per_process=2, mesh=MeshConfig(pipeline=2, fsdp=1)))},
     "islands are the stages"),
    # Accepted, then refused once the island was built, naming config.mesh.tensor (which
    # islands forbid); tiny's 2 kv heads do not split 4 ways.
    ({"islands": (IslandConfig(name="a", devices_per_process=4, mesh=MeshConfig(fsdp=1, tensor=4)),
                  IslandConfig(name="b"))},
     "config.model.num_kv_heads=2 does not split over config.hetero.islands\\[0\\].mesh.tensor=4"),
])
def test_bad_island_configs_are_refused_naming_the_field(hetero, match):
    with pytest.raises(ConfigError, match=match):
        validate(tiny_islands(**hetero))


@pytest.mark.parametrize("overrides, hetero, match", [
    ({"pipeline.microbatches": "16"}, {}, "a micro-batch of .* = 1 rows does not split over .*islands\\[0\\]"),
    # The remainder first: a micro-batch check of 16/3 = 5 rows blamed the sharding.
    ({"pipeline.microbatches": "3"}, {}, "config.batch_size=16 is not divisible by config.pipeline.microbatches=3"),
    ({"optim.grad_accum_steps": "2"}, {}, "grad_accum_steps=2 .* the islands are the stages"),
    ({"checkpoint.keep": "1"}, {}, "checkpoint.keep=1 with islands"),
    ({"pipeline.virtual_stages": "2", "pipeline.schedule": "1f1b_fused"}, {},
     "virtual_stages=2 with config.hetero.placement='pipeline'"),
    ({"pipeline.microbatches": "1"}, {"placement": "data", "islands": (
        IslandConfig(name="a", devices_per_process=2, mesh=MeshConfig(pipeline=2, fsdp=1)), IslandConfig(name="b"))},
     "islands\\[0\\].mesh.pipeline=2: config.pipeline.microbatches=1 is smaller"),
    ({"pipeline.stage_layers": "(1,3)", "model.num_layers": "4"}, {"placement": "data", "islands": (
        IslandConfig(name="a", devices_per_process=2, mesh=MeshConfig(pipeline=2, fsdp=1)), IslandConfig(name="b"))},
     "islands\\[0\\].mesh.pipeline=2 with uneven config.pipeline.stage_layers=\\(1, 3\\)"),
    ({"pipeline.virtual_stages": "2", "pipeline.schedule": "1f1b_fused"}, {"placement": "data"},
     "virtual_stages=2 with config.hetero.placement='data'"),
    ({"sharding.grad_sync": "once"}, {}, "grad_sync='once' with config.hetero.placement='pipeline'"),
    ({"sharding.grad_sync": "once", "pipeline.microbatches": "2"}, {"placement": "data", "islands": (
        IslandConfig(name="a", devices_per_process=2, mesh=MeshConfig(pipeline=2, fsdp=1)), IslandConfig(name="b"))},
     "islands\\[0\\].mesh.pipeline=2: config.sharding.grad_sync='once' with config.mesh.pipeline=2"),
    # Accepted and ignored, even when it did not add up to the model's 2 layers.
    ({"pipeline.stage_layers": "(5,7,9)"}, {"placement": "data"},
     "stage_layers=\\(5, 7, 9\\) with placement='data' and no island running a pipeline"),
    ({}, {"placement": "data", "island_layers": (1, 1)}, "island_layers=\\(1, 1\\) / auto_split=False with "
                                                         "placement='data'"),
    ({"batch_size": "5"}, {"placement": "data"}, "config.batch_size=5: 5 cannot be split over the islands in "
                                                 "positive multiples of \\(2, 2\\)"),
    ({}, {"placement": "data", "islands": tuple(IslandConfig(name=n, devices_per_process=2, mesh=MeshConfig(fsdp=2))
                                                for n in "abc"),
          "links": (LinkConfig(backend="local"),) * 2, "link": LinkConfig(backend="local", checksum="crc32")},
     "with placement='data' every island talks to every other one"),
])
def test_bad_job_settings_for_islands_are_refused_naming_the_field(overrides, hetero, match):
    with pytest.raises(ConfigError, match=match):
        validate(tiny_islands(overrides, **hetero))


def test_an_island_s_own_pipeline_is_checked_against_its_share_of_the_batch():
    """Data placement: island a (2 stages, 4 micro-batches) takes 4 of 6 rows, which was
    refused because 6, the whole batch, does not divide by 4."""
    from hetjax.hetero import placement
    cfg = tiny_islands({"batch_size": "6", "model.num_layers": "4", "pipeline.schedule": "gpipe",
                        "pipeline.microbatches": "4"}, placement="data", islands=(
        IslandConfig(name="a", devices_per_process=2, mesh=MeshConfig(pipeline=2, fsdp=1)),
        IslandConfig(name="b", devices_per_process=1, mesh=MeshConfig(fsdp=1))))
    validate(cfg)
    assert placement.batch_shares(cfg) == ((0, 4), (4, 2))
    # Shares follow the rules' `batch` axes: over tensor too, island b's rows must be even
    # (it was given 11 of 16, refused once built, naming a config.mesh.tensor islands forbid).
    rules = tuple((k, ("data", "fsdp", "tensor") if k == "batch" else None if k in ("mlp", "heads", "kv_heads", "vocab")
                   else v) for k, v in cfg.sharding.rules)
    cfg = dataclasses.replace(tiny_islands({"batch_size": "16"}, placement="data", islands=(
        IslandConfig(name="a", devices_per_process=1, mesh=MeshConfig(fsdp=1), speed=1.0),
        IslandConfig(name="b", devices_per_process=2, mesh=MeshConfig(fsdp=1, tensor=2), speed=2.0))),
        sharding=dataclasses.replace(cfg.sharding, rules=rules))
    validate(cfg)
    assert placement.batch_shares(cfg) == ((0, 6), (6, 10))


def test_a_micro_batch_must_split_over_the_mesh_axes_the_batch_rule_names():
    """Pipeline islands check each micro-batch against config.sharding.rules' `batch`
    axes, not a fixed data x fsdp: rows the rules keep whole over fsdp are accepted (they
    were refused), rows the rules also split over tensor are refused naming the rule
    before anything compiles (it was jax's IndivisibleError from inside the step)."""
    def with_batch_rule(axes, mesh):
        cfg = tiny_islands({"pipeline.microbatches": "8", "batch_size": "8"}, islands=tuple(
            IslandConfig(name=n, devices_per_process=2, mesh=mesh) for n in ("a", "b")))
        rules = tuple((k, axes if k == "batch" else v) for k, v in cfg.sharding.rules)
        return dataclasses.replace(cfg, sharding=dataclasses.replace(cfg.sharding, rules=rules))

    validate(with_batch_rule(("data",), MeshConfig(fsdp=2)))  # 1 row a micro-batch, not split
    with pytest.raises(ConfigError, match=r"8/8 = 1 rows does not split over config.hetero.islands\[0\]'s "
                                          r"data x fsdp = 2 devices \(config.sharding.rules maps 'batch' to"):
        validate(with_batch_rule(("data", "fsdp"), MeshConfig(fsdp=2)))
    with pytest.raises(ConfigError, match=r"islands\[0\]'s data x fsdp x tensor = 2 devices"):
        validate(with_batch_rule(("data", "fsdp", "tensor"), MeshConfig(fsdp=1, tensor=2)))


def test_islands_whose_configs_disagree_name_the_difference():
    a = tiny_islands()
    b = a.__class__(**{**a.__dict__, "seed": 7})
    b = b.__class__(**{**b.__dict__, "model": b.model.__class__(**{**b.model.__dict__, "embed_dim": 32})})
    diff = job_lib.differences(json.loads(json.dumps(job_lib.agreed(a))), json.loads(json.dumps(job_lib.agreed(b))))
    assert diff == ["config.model.embed_dim: 64 vs 32", "config.seed: 0 vs 7"]
    # Where each process runs (compile profile, run directory) may differ.
    c = a.__class__(**{**a.__dict__, "run_dir": "elsewhere"})
    assert job_lib.differences(job_lib.agreed(a), job_lib.agreed(c)) == []


def test_a_silent_island_is_a_timeout_naming_it():
    cfg = tiny_islands(link=LinkConfig(backend="local", timeout_s=0.5))
    links = Links(cfg, 0)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1, 1),
                             ("pipeline", "data", "fsdp", "tensor"))
    with pytest.raises(IslandLost, match="island b \\(rank 0\\) stopped answering island a"):
        links.gather(np.zeros(2, np.float32), "never-sent", mesh)


def test_llama8b_hetero_describes_a_job_each_island_can_hold():
    from hetjax import sharding
    from hetjax.hetero.island import Geometry
    cfg = load("llama8b_hetero.py")
    validate(cfg)
    split = placement.island_layers(cfg)
    assert sum(split) == 32 and split[1] > split[0]  # the faster island holds more layers
    for spec, layers in zip(cfg.hetero.islands, split):
        mesh = Geometry.of(spec, virtual=False).abstract_mesh()
        assert dict(mesh.shape)["fsdp"] == 8
        sharding.check_divisible({**cfg.model.dims(), "layers": ("", layers)}, cfg.sharding.rules, mesh)


def test_auto_split_times_a_layer_on_each_island_and_balances_by_it():
    from hetjax.hetero.island import Geometry, make_mesh
    from hetjax.hetero.profile import seconds_per_layer
    cfg = tiny_islands(auto_split=True)
    validate(cfg)
    mesh = make_mesh(Geometry.of(cfg.hetero.islands[0], True), jax.devices()[:2])
    t = seconds_per_layer(cfg, mesh, repeats=2)
    assert 0 < t < 10
    # An island twice as slow per layer gets half as many layers.
    speeds = placement.balance([2 * t, t])
    assert placement.island_layers(cfg.__class__(**{**cfg.__dict__, "model": cfg.model.__class__(
        **{**cfg.model.__dict__, "num_layers": 6})}), speeds) == (2, 4)


def test_islands_start_from_a_one_island_checkpoint(tmp_path):
    # Weights saved by a one-island run at step 2, loaded by islands that then train on
    # batch 2: the loss at step 2 is the one-island run's (same weights, same batch).
    one, one_dir = losses(tmp_path, "tiny.py", "one", "--config.checkpoint.every=2", "--config.steps=3")
    config = write_config(tmp_path, "islands", '''
        islands = (IslandConfig(name="a", devices_per_process=2, mesh=MeshConfig(fsdp=2)),
                   IslandConfig(name="b", devices_per_process=1, mesh=MeshConfig(fsdp=1)))
        return dataclasses.replace(cfg, hetero=HeteroConfig(islands=islands))
    ''')
    run_dir = tmp_path / "islands"
    assert train.main(["--config", str(config), f"--config.run_dir={run_dir}", "--config.steps=3",
                       "--config.data.start_step=2", f"--config.init_from={one_dir}/checkpoints/2",
                       "--config.eval_every=0", "--config.tensorboard=False"]) == 0
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 2
    np.testing.assert_allclose(row["loss"], one[2], rtol=1e-5)


def test_islands_checkpoints_that_cannot_be_resumed_are_set_aside_or_refused_before_an_island_is_built(
        tmp_path, monkeypatch):
    """A first save cut short stopped every later start; an islands run's checkpoints given
    to export or init_from were tracebacks; config.steps below the saved step, other data and
    another placement were refused only after every island had compiled."""
    run_dir = tmp_path / "run"
    args = ["--config", "tiny_hetero.py", f"--config.run_dir={run_dir}", "--config.eval_every=0",
            "--config.tensorboard=False", "--config.checkpoint.async_save=False"]
    assert train.main([*args, "--config.steps=2"]) == 0

    # Killed in its first save: one island had saved step 2, the other not. That step is set
    # aside and the job starts anew; it used to refuse every start ("no step in common").
    import shutil
    shutil.copytree(run_dir, tmp_path / "cut")
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "rocm" / "2")
    said = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: said.append(" ".join(map(str, a))))
    assert train.main([*args[:2], f"--config.run_dir={tmp_path / 'cut'}", *args[3:], "--config.steps=2"]) == 0
    monkeypatch.undo()
    assert any("moved the unfinished" in line and "first save" in line for line in said), said[-20:]
    assert [p.name.split("-")[:2] for p in (tmp_path / "cut" / "checkpoints" / "corrupt").iterdir()] == [["cuda", "2"]]
    rows = [json.loads(l) for l in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [0, 1]

    # Its checkpoints are parts of a model: export and init_from say how to put them together
    # (they were tracebacks, or "no readable checkpoint" after a compile).
    from hetjax import convert
    for path, message in ((run_dir, "holds an islands job's checkpoints, one folder per island \\(cuda, rocm\\)"),
                          (run_dir / "checkpoints" / "cuda", "is one island's part of an islands job")):
        with pytest.raises(ConfigError, match=message):
            convert.export_hf(path, tmp_path / "hf")
    with pytest.raises(ConfigError, match="holds an islands job's checkpoints"):
        train.main(["--config", "tiny.py", f"--config.run_dir={tmp_path / 'one'}", f"--config.init_from={run_dir}"])

    def no_island(*a, **k):
        raise AssertionError("built an island before refusing the checkpoint")
    monkeypatch.setattr(job_lib, "Worker", no_island)
    for change, message in ((["--config.steps=1"], r"config.steps=1: .* already holds step 2"),
                            (["--config.steps=4", "--config.data.branching=4"], "saved data iterator state is for data"),
                            (["--config.steps=4", "--config.hetero.placement=data"],
                             r"config.hetero.placement='pipeline' but this config has 'data'")):
        with pytest.raises(ConfigError, match=message):
            train.main([*args, *change])
    # Shapes (a wider model) and init_from's, from the checkpoints' metadata before the
    # islands' programs compile (they were found by the restore, after it).
    monkeypatch.undo()

    def no_compile(*a, **k):
        raise AssertionError("compiled an island's programs before refusing the checkpoint")
    monkeypatch.setattr(job_lib, "PipelineStage", no_compile)
    with pytest.raises(ConfigError, match=r"checkpoint step 2 .* 'blocks/mlp/down_FD' has shape"):
        train.main([*args, "--config.steps=4", "--config.model.mlp_dim=128"])
    one = tmp_path / "one_mesh"
    assert train.main(["--config", "tiny.py", f"--config.run_dir={one}", "--config.steps=1", "--config.eval_every=0",
                       "--config.tensorboard=False", "--config.model.num_layers=4"]) == 0
    with pytest.raises(ConfigError, match=r"checkpoint step 1 in .*one_mesh.* has shape"):
        train.main([*args[:2], f"--config.run_dir={tmp_path / 'fresh'}", *args[3:], "--config.steps=2",
                    f"--config.init_from={one}"])
    with pytest.raises(ConfigError, match=r"config.hetero.islands\[0\].name='0': name an island with a letter"):
        validate(tiny_islands(islands=(IslandConfig(name="0"), IslandConfig(name="b"))))


def test_an_island_too_small_for_its_part_is_refused_before_allocating(tmp_path):
    with pytest.raises(ConfigError, match="island (cuda|rocm) \\(config.hetero.islands\\[[01]\\]\\): .* needs about"):
        train.main(["--config", "tiny_hetero.py", f"--config.run_dir={tmp_path}", "--config.device_memory_gib=1e-5"])
    assert not (tmp_path / "checkpoints").exists()


def test_virtual_islands_save_asynchronously_and_resume(tmp_path):
    # The README's job as its command runs it, in a process of its own (inside pytest's
    # process the failure did not show): the islands' threads start asynchronous orbax
    # saves in one process, and started together they mixed up each other's temporary
    # directories, so the job failed at its first checkpoint.
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hetjax.train", "--config", "configs/tiny_hetero.py", f"--config.run_dir={run_dir}",
            "--config.eval_every=0", "--config.checkpoint.every=2", "--config.checkpoint.keep=3"]
    # No device count (the job sets its own), but the suite's other XLA flags (conftest).
    env = dict(cpu_env(None), PYTHONPATH=str(ROOT))
    run = subprocess.run(args + ["--config.steps=6"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0 and "ERROR" not in run.stderr, run.stderr[-3000:]
    # As if process 1 of the rocm island could not read step 6 at the last start (the note
    # it leaves; hetjax/checkpoint_readable.py): every island sets step 6 aside and resumes at 4.
    (run_dir / "checkpoints" / "rocm" / "6" / "unreadable-by-process-1.txt").write_text("damaged shard\n")
    run = subprocess.run(args + ["--config.steps=8"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0 and "ERROR" not in run.stderr, run.stderr[-3000:]
    assert "could not be read by every process of the last start (unreadable-by-process-1.txt)" in run.stdout
    assert run.stdout.count("moved the partly unreadable checkpoint") == 1, run.stdout  # rocm's
    assert "resumed every island from step 4" in run.stdout, run.stdout
    assert len(list((run_dir / "checkpoints" / "corrupt").iterdir())) == 2  # both islands' step 6
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows if "loss" in r}) == list(range(8))
    for name in ("cuda", "rocm"):
        assert checkpoint.Manager(run_dir / "checkpoints" / name).steps() == [4, 6, 8]
    # Every step unreadable: each is set aside, and the start stops, saying so, where it used
    # to train again from step 0 as if nothing had been saved.
    for step in (4, 6, 8):
        (run_dir / "checkpoints" / "rocm" / str(step) / "unreadable-by-process-1.txt").write_text("damaged shard\n")
    run = subprocess.run(args + ["--config.steps=10"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode != 0 and "none of the islands' checkpoints could be read (steps [8, 6, 4]" in run.stdout + run.stderr, \
        (run.stdout + run.stderr)[-3000:]
    assert len(list((run_dir / "checkpoints" / "corrupt").iterdir())) == 8  # all of both islands' steps, kept
    assert sorted({r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                   if "loss" in r}) == list(range(8))  # the metrics too


def test_an_island_ahead_never_deletes_the_last_step_a_lagging_island_holds(tmp_path):
    """Islands save at their own pace. When one island's saves lag (a slow disk: its saves
    are held back here, then let through), the other's keep-the-last-N must not delete
    every step the lagging one has: a job resumes all islands at one common step."""
    from hetjax import data
    cfg = load("tiny_hetero.py", {"steps": "100", "run_dir": str(tmp_path / "run"), "checkpoint.keep": "1",
                                  "checkpoint.async_save": "False"})
    job = job_lib.IslandsJob(cfg, data.build(cfg), log=lambda line: None)
    ahead, lagging = (w.manager for w in job.workers)
    held_back, save = [], lagging.save
    lagging.save = lambda *args: held_back.append(args)
    try:
        def checkpoint_at(step):
            job.checkpoints.save(step, job.state, job.batches.get_state(), {})

        for step in (2, 4, 6, 8):
            checkpoint_at(step)
        assert lagging.steps() == [] and ahead.steps() == [2, 4, 6, 8]  # keep=1 would leave [8]
        save(*held_back.pop(0))  # the lagging island's step 2 lands; its later saves still lag
        assert job.checkpoints.steps() == [2]
        for step in (10, 12):  # the exchanges now agree on step 2, and only on it
            checkpoint_at(step)
        assert ahead.steps() == [2, 4, 6, 8, 10, 12] and job.checkpoints.steps() == [2]

        for args in held_back:  # the lagging island catches up
            save(*args)
        lagging.save = save
        for step in (14, 16):  # both hold 2..12: the exchange at 14 lets 16 delete below 12
            checkpoint_at(step)
        assert ahead.steps() == lagging.steps() == [12, 14, 16]
    finally:
        job.checkpoints.close()
        job.close()


def test_a_checkpoint_of_islands_in_another_order_is_refused():
    """Each island's part of a checkpoint is kept under its name: three islands put in
    another order would each restore layers they no longer hold, with the same shapes."""
    from hetjax.config import to_dict
    from hetjax.hetero.checkpoints import check_placement

    def islands(*names):
        return dataclasses.replace(cfg, hetero=HeteroConfig(islands=tuple(
            IslandConfig(name=n, devices_per_process=2, mesh=MeshConfig(fsdp=2)) for n in names)))
    cfg = load("tiny.py")
    saved = json.loads(json.dumps(to_dict(islands("a", "b", "c"))))  # as the checkpoint keeps it
    check_placement(islands("a", "b", "c"), saved, "step 2")  # the same order is taken
    with pytest.raises(ConfigError, match=r"step 2 was written with config.hetero.islands \(their order\)="
                                          r"\['a', 'b', 'c'\] but this config has \['a', 'c', 'b'\]"):
        check_placement(islands("a", "c", "b"), saved, "step 2")


def test_a_resume_under_another_layer_split_is_refused_before_compiling(tmp_path, monkeypatch, capsys):
    """The split follows the islands' speeds (or auto_split's measurement, taken at each
    start): a step saved as 2 + 2 layers, resumed as 3 + 1, used to fail only once every
    island had compiled, with an error that blamed config.model."""
    config = write_config(tmp_path, "speeds", '''
        import os
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=4))
        islands = (IslandConfig(name="cuda", devices_per_process=2, mesh=MeshConfig(fsdp=2),
                                speed=float(os.environ["SPEED0"])),
                   IslandConfig(name="rocm", devices_per_process=2, mesh=MeshConfig(fsdp=2)))
        return dataclasses.replace(cfg, hetero=HeteroConfig(islands=islands))
    ''')
    args = ["--config", str(config), f"--config.run_dir={tmp_path / 'run'}", "--config.eval_every=0",
            "--config.tensorboard=False", "--config.checkpoint.async_save=False"]
    monkeypatch.setenv("SPEED0", "1")
    assert train.main([*args, "--config.steps=2"]) == 0
    monkeypatch.setenv("SPEED0", "3")
    compiled = []
    monkeypatch.setattr(job_lib, "Worker", lambda *a, **k: compiled.append(a) or pytest.fail("built an island"))
    with pytest.raises(ConfigError, match=r"holds 2 layers of island 'cuda', which this start places 3 layers on .*"
                                          r"--config.hetero.island_layers=\(2, 2\) restores"):
        train.main([*args, "--config.steps=4"])
    assert not compiled
    monkeypatch.undo()
    monkeypatch.setenv("SPEED0", "3")
    assert train.main([*args, "--config.steps=4", "--config.hetero.island_layers=(2,2)"]) == 0  # as it says
    # Under auto_split a resumed job keeps its checkpoints' split: measured anew (here cuda
    # three times as fast as rocm, 3 + 1), it was refused, with advice that auto_split refuses.
    monkeypatch.setattr(job_lib, "seconds_per_layer", lambda *a, **k: pytest.fail("measured again"))
    capsys.readouterr()
    assert train.main([*args, "--config.steps=5", "--config.hetero.auto_split=True"]) == 0
    assert "resuming with the split the checkpoints hold, (2, 2)" in capsys.readouterr().out
    # Process mode sees one island's checkpoints: its advice named a split of that island alone.
    with pytest.raises(ConfigError, match=r"places 3 layers on \(the split .*\); set config.hetero.island_layers so,"):
        from hetjax.hetero.checkpoints import check_saved_placement
        check_saved_placement(load(str(config), {"run_dir": str(tmp_path / "run")}), ["cuda"], {"cuda": 3})


def test_an_island_s_error_waits_for_the_other_islands_threads_before_it_is_raised():
    """Virtual islands: one island's ConfigError was raised while another's thread was still
    compiling; the interpreter then exited under it and aborted (exit 134, not 2)."""
    import threading
    import time as time_lib

    from hetjax.hetero import job as job_lib
    job = object.__new__(job_lib.IslandsJob)
    job.cfg, job._links = tiny_islands(), []
    finished = threading.Event()

    def build(k):
        if k == 0:
            raise ConfigError("island a: refused")
        time_lib.sleep(1.0)  # island b, still compiling
        finished.set()
    with pytest.raises(ConfigError, match="island a: refused"):
        job._run([0, 1], build)
    assert finished.is_set()
