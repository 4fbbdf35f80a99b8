"""Run fingerprints (hetjax.repro): exact digests, compare and check, end to end."""

import dataclasses
import importlib.util
import json
import math
import os
import shutil

import jax
import numpy as np
import pytest

from flax import nnx

from hetjax import data, program, sharding
from hetjax import state as state_lib
from hetjax.config import Config, ConfigError, MeshConfig, ModelConfig, load, validate
from hetjax.mesh import make_mesh
from hetjax.optim import learning_rate_schedule
from hetjax.pipeline.stages import make_layout, map_blocks, to_stages
from hetjax.repro import check, compare, digest as fp, platforms as platforms_lib, read
from hetjax.repro.__main__ import main as repro_main

CFG = Config(model=ModelConfig(vocab_size=64, num_layers=3, embed_dim=32, mlp_dim=64, num_heads=4,
                               num_kv_heads=4, head_dim=8), batch_size=8, seq_len=16)


@pytest.fixture(scope="module")
def params():
    """The initial parameters, created once on one device (sharded copies are device_puts)."""
    return nnx.split(state_lib.make_model(CFG.model, CFG.seed))[1]


def sharded(params, mesh_cfg):
    mesh = make_mesh(mesh_cfg)
    return jax.device_put(params, sharding.state_shardings(params, mesh, CFG.sharding.rules))


def test_parameter_digest_is_layout_independent_and_norms_match_numpy(params):
    a = fp.param_fingerprint(sharded(params, MeshConfig(fsdp=8)))
    b = fp.param_fingerprint(sharded(params, MeshConfig(fsdp=2, tensor=4)))
    assert a.digest == b.digest and a.tensors.keys() == b.tensors.keys()
    host = {k: np.asarray(v, np.float64) for k, v in _named(jax.device_get(params))}
    layers = {f"{k}[{i}]": x[i] for k, x in host.items() if k.startswith("blocks/") for i in range(len(x))}
    whole = {k: x for k, x in host.items() if not k.startswith("blocks/")}
    assert set(a.tensors) == set(layers) | set(whole) and "blocks/attn/q_DNH[2]" in a.tensors
    for name, x in {**layers, **whole}.items():
        np.testing.assert_allclose(a.tensors[name].norm, np.linalg.norm(x.ravel()), rtol=1e-6)
        np.testing.assert_allclose(b.tensors[name].norm, np.linalg.norm(x.ravel()), rtol=1e-6)


def _named(params):
    from hetjax.repro.digest import path_name as _path
    return [(_path(p), x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]]


def test_parameter_digest_adds_over_layer_ranges_and_sees_one_bit(params):
    params = jax.device_get(params)
    whole = fp.param_fingerprint(params)
    head = fp.param_fingerprint(map_blocks(lambda x: x[:1], params))  # layer 0 + embedding, norm, head
    tail = fp.param_fingerprint(map_blocks(lambda x: x[1:], {"blocks": params["blocks"]}), layer_offset=1)
    parts = head + tail
    assert parts.digest == whole.digest
    assert {k: t.hash for k, t in parts.tensors.items()} == {k: t.hash for k, t in whole.tensors.items()}
    assert (head.digest + tail.digest) % 2**64 == whole.digest
    with pytest.raises(ValueError, match="overlapping"):
        head + head
    # One flipped bit in layer 2 of one leaf changes that part's hash and no other.
    flipped = jax.tree.map(lambda x: x, params)
    q = np.array(flipped["blocks"]["attn"]["q_DNH"].get_value())
    q.view(np.uint32)[2, 3, 1, 0] ^= 1
    flipped["blocks"]["attn"]["q_DNH"].set_value(q)
    other = fp.param_fingerprint(flipped)
    changed = {k for k in whole.tensors if whole.tensors[k].hash != other.tensors[k].hash}
    assert changed == {"blocks/attn/q_DNH[2]"} and other.digest != whole.digest


def test_parameter_digest_of_a_padded_pipeline_layout_is_the_model_s(params):
    layout = make_layout(3, 2, (1, 2))  # uneven: padded to 2 stages x 2 layers
    padded = jax.jit(lambda p: to_stages(p, layout))(params)
    assert fp.param_fingerprint(padded, layout=layout).digest == fp.param_fingerprint(params).digest
    assert fp.param_fingerprint(padded).digest != fp.param_fingerprint(params).digest  # 4 layers, not 3


def _numpy_leaf_words(x: np.ndarray) -> np.ndarray:
    """digest.leaf_words written out in numpy: what every checkpoint's checksums are made of,
    so a change that moves one bit would leave saved checkpoints unverifiable."""
    def mix32(v):
        v = v ^ (v >> np.uint32(16))
        v = v * np.uint32(0x85EBCA6B)
        v = v ^ (v >> np.uint32(13))
        v = v * np.uint32(0xC2B2AE35)
        return v ^ (v >> np.uint32(16))
    x = np.ascontiguousarray(x.astype(np.uint8) if x.dtype == np.bool_ else x)
    if x.dtype.itemsize == 8:
        bits = x.view(np.uint32).reshape(*x.shape, 2)
    else:
        bits = x.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[x.dtype.itemsize]).astype(np.uint32)
    index = (np.arange(bits.size, dtype=np.uint64) % 2**32).astype(np.uint32).reshape(bits.shape)
    return np.array([np.sum(mix32(bits ^ mix32(index * np.uint32(2) + np.uint32(salt))), dtype=np.uint32)
                     for salt in (1, 0x9E3779B9)], np.uint32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "uint16", "int32", "bool"])
def test_leaf_words_are_the_numpy_formula_for_any_sharding(dtype):
    rng, shape = np.random.default_rng(7), (8, 6, 5)
    if dtype == "bool":
        host = rng.integers(0, 2, shape).astype(bool)
    else:  # every bit pattern, NaNs' payloads included
        width = jax.numpy.dtype(dtype).itemsize
        host = rng.integers(0, 2**(8 * width), shape, dtype=f"uint{8 * width}").view(jax.numpy.dtype(dtype))
    want = _numpy_leaf_words(host)
    assert (np.asarray(fp.leaf_words(host)) == want).all()
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    spread = jax.device_put(host, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", "data")))
    assert (np.asarray(jax.jit(fp.leaf_words)(spread)) == want).all()
    rows = np.asarray(jax.vmap(fp.leaf_words)(host))  # a stacked leaf's per-layer words
    assert all((rows[k] == _numpy_leaf_words(host[k])).all() for k in range(len(host)))
    assert (np.asarray(fp.leaf_words(host[:1, :1, :1].reshape(()))) == _numpy_leaf_words(host[:1, :1, :1].reshape(()))).all()


def test_batch_digest_is_exact_for_any_sharding_and_adds_over_rows():
    cfg = dataclasses.replace(CFG, mesh=MeshConfig(data=2, fsdp=4))
    mesh = make_mesh(cfg.mesh)
    stream = data.build(cfg)
    batch = stream.batch(3, program.batch_shardings(mesh, cfg.sharding.rules))
    host = {k: np.asarray(v) for k, v in batch.items()}
    digest = fp.batch_digest(batch)
    assert digest == fp.batch_digest(host)
    assert (fp.batch_digest({k: v[:3] for k, v in host.items()}) +
            fp.batch_digest({k: v[3:] for k, v in host.items()}, rows=3)) % 2**64 == digest
    swapped = {k: v[[1, 0, *range(2, len(v))]] for k, v in host.items()}
    assert fp.batch_digest(swapped) != digest  # a row's place in the batch counts
    assert fp.batch_digest({k: np.asarray(v) for k, v in stream.batch(4, program.batch_shardings(
        mesh, cfg.sharding.rules)).items()}) != digest


def test_batch_digest_is_the_sum_of_its_rows_part_hashes():
    """combine_rows spells part_hash out for speed; its value stays the definition's:
    the sum mod 2**64 of part_hash("row", global row, field, the row's 16 hex digits)."""
    rng = np.random.default_rng(3)
    words = {k: rng.integers(0, 2**32, size=(6, 2), dtype=np.uint32) for k in ("targets", "inputs", "loss_mask")}
    for rows in (None, 7, np.array([9, 2, 40, 3, 5, 11])):
        at = np.arange(6) + (rows or 0) if rows is None or np.isscalar(rows) else rows
        want = sum(fp.part_hash("row", int(r), k, fp.words_hex(words[k][i]))
                   for k in words for i, r in enumerate(at)) % 2**64
        assert fp.combine_rows(words, rows) == want


def test_layouts_are_parsed_and_bad_ones_refused():
    parsed = check.parse("fsdp=8; fsdp=2,tensor=4; pipeline=2; pipeline=2,virtual_stages=2")
    lays = [check.layout(n, s, CFG, 8) for n, s in parsed]
    assert [(l.overrides["mesh.fsdp"], l.overrides["mesh.tensor"], l.overrides["mesh.pipeline"], l.devices)
            for l in lays] == [("8", "1", "1", 8), ("2", "4", "1", 8), ("-1", "1", "2", 8), ("-1", "1", "2", 8)]
    assert lays[3].overrides["pipeline.virtual_stages"] == "2" and "virtual_stages" not in str(lays[2].overrides)
    assert lays[3].overrides.get("pipeline.schedule", CFG.pipeline.schedule) in ("gpipe", "1f1b_fused")
    for bad, word in (("fsdp=8", "at least two"), ("fsdp=8; tensr=2", "tensr=2"), ("fsdp=8; islands=2,fsdp=2", "islands"),
                      ("fsdp=8; fsdp=4,fsdp=2", "names fsdp twice")):
        with pytest.raises(ConfigError, match=word):
            check.parse(bad)
    if importlib.util.find_spec("hetjax.hetero") is None:
        with pytest.raises(ConfigError, match="hetjax.hetero"):
            check.layout("islands=2", {"islands": 2}, CFG, 8)
        return
    # Islands with interleaved chunks: each of 2 islands holds 2 chunks of the 4 layers.
    (name, sizes), = check.parse("islands=2,virtual_stages=2; fsdp=8")[:1]
    four = load("tiny", {"model.num_layers": "4"})
    got = load(check.layout(name, sizes, four, 8, "tiny").config, {"model.num_layers": "4"})
    validate(got)
    assert (len(got.hetero.islands), got.pipeline.virtual_stages, got.pipeline.schedule) == (2, 2, "1f1b_fused")
    with pytest.raises(ConfigError, match="islands=2,virtual_stages=2: config.model.num_layers=3"):
        check.layout(name, sizes, CFG, 8, "tiny")


def test_a_layout_the_model_cannot_split_is_refused_before_any_run(tmp_path, monkeypatch):
    """It used to be found only when its turn came, after the earlier layouts had trained."""
    monkeypatch.setattr(check, "run", lambda *a, **k: pytest.fail("trained before checking every layout"))
    with pytest.raises(ConfigError, match=r"vocab_size=256 does not split over config.mesh.tensor=3"):
        check.check("tiny", "fsdp=8; fsdp=2,tensor=3", tmp_path / "out", devices=6)
    # A layout that names virtual_stages without pipeline stages would train plain fsdp.
    with pytest.raises(ConfigError, match=r"virtual_stages=2 with config.mesh.pipeline=1"):
        check.check("tiny", "fsdp=8; fsdp=8,virtual_stages=2", tmp_path / "out", devices=8)


@pytest.mark.parametrize("command", [["check", "--layouts", "fsdp=8; fsdp=4"], ["platforms", "--platforms", "cpu,cpu"]])
@pytest.mark.parametrize("flag", ["--config.steps=5", "--config.fingerprint_every=1"])
def test_check_and_platforms_refuse_a_config_override_of_what_they_set(command, flag, tmp_path, monkeypatch, capsys):
    """platforms used to train --steps' count silently over a --config.steps override."""
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: pytest.fail("trained before refusing"))
    assert repro_main([command[0], "--config", "tiny", *command[1:], "--steps", "2", "--out",
                       str(tmp_path / "out"), flag]) == 2
    err = capsys.readouterr().err
    assert f"{flag}: hetjax.repro {command[0]} sets it to" in err and "instead" in err, err


def fake_run(run_dir, steps: int, params_at=(0,), mesh=None, **config):
    """A fingerprints.jsonl as a finished run of `steps` steps writes it, without training:
    every loss 1.0, the same batch and parameter digests."""
    config = {"steps": steps, "name": "x", "profile_steps": "", "wandb": {"project": ""}, **config}
    header = {"kind": "header", "step": 0, "platform": "cpu", "device_kind": "cpu", "jax": "0", "profile": "cpu",
              "mesh": {"fsdp": 8} if mesh is None else mesh, "config": config}
    rows = [header] + [{"kind": "step", "step": s, "loss": 1.0, "grad_norm": 1.0, "batch": "0" * 16}
                       for s in range(steps)]
    rows += [{"kind": "params", "step": s, "params": "1" * 16, "norms": {"w": 1.0}} for s in params_at]
    run_dir.mkdir(parents=True)
    (run_dir / "fingerprints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_runs_that_both_finished_different_config_steps_are_void_for_that_reason(tmp_path):
    """It said B 'stopped early (killed, diverged) or is still running' of a run that
    finished the 5 steps its config asked for."""
    r = compare.compare(fake_run(tmp_path / "a", 6), fake_run(tmp_path / "b", 5))
    assert r.code == compare.VOID and "stopped early" not in r.void, r.void
    assert r.void.startswith("config.steps differs: run A trains 6 steps, run B 5, and both finished"), r.void
    assert r.config_diff == {"steps": (6, 5)}
    rows = (tmp_path / "b" / "fingerprints.jsonl").read_text().splitlines()
    (tmp_path / "c").mkdir()  # B's config trains 5 steps, but it was killed after 3
    (tmp_path / "c" / "fingerprints.jsonl").write_text("\n".join(r for r in rows if '"step": 3' not in r
                                                                  and '"step": 4' not in r) + "\n")
    assert "run B ends at step 2 (its config trains 5)" in compare.compare(tmp_path / "b", tmp_path / "c").void


def test_a_run_lacking_steps_in_the_middle_is_void_and_a_garbled_line_is_named(tmp_path):
    """Run B with steps 0 and 19 of 20 was BIT-IDENTICAL (2 steps compared), and a line
    that was not JSON was skipped wherever it was."""
    a, b = fake_run(tmp_path / "a", 20), fake_run(tmp_path / "b", 20)
    rows = (b / "fingerprints.jsonl").read_text().splitlines()
    kept = [r for r in rows if '"kind": "step"' not in r or any(f'"step": {s},' in r for s in (0, 19))]
    (b / "fingerprints.jsonl").write_text("\n".join(kept) + "\n")
    r = compare.compare(a, b)
    assert r.code == compare.VOID and r.void.startswith("run B has no fingerprint for steps 1..18, which the other"), r.void
    # A run that began later (init_from, or another run's checkpoint) lacks nothing of its own.
    late = tmp_path / "late"
    late.mkdir()
    (late / "fingerprints.jsonl").write_text("\n".join(r for r in rows if '"kind": "step"' not in r or any(
        f'"step": {s},' in r for s in range(10, 20))) + "\n")
    assert compare.compare(a, late).void is None and compare.compare(a, late).steps == list(range(10, 20))
    (b / "fingerprints.jsonl").write_text("\n".join(rows[:3] + ['{"kind": "st'] + rows[3:]) + "\n")
    with pytest.raises(ConfigError, match=r"fingerprints.jsonl:4: not a JSON line; the file is damaged"):
        compare.compare(a, b)
    (b / "fingerprints.jsonl").write_text("\n".join(rows) + '\n{"kind": "st')  # a killed run's torn last line
    assert compare.compare(a, b).identical


def test_bookkeeping_fields_are_not_config_differences(tmp_path):
    a = fake_run(tmp_path / "a", 3, name="a", profile_steps="1:2", wandb={"project": "p", "name": "a"})
    r = compare.compare(a, fake_run(tmp_path / "b", 3))
    assert r.config_diff == {} and r.identical, compare.describe(r)
    assert compare.config_diff({"name": "a", "name_x": 1}, {"name": "b", "name_x": 2}) == {"name_x": (1, 2)}


def test_an_islands_run_is_described_by_its_islands_not_as_one_device(tmp_path):
    """An islands job records no one mesh (each island has its own): compare said 'mesh one device'."""
    islands = [{"name": "cuda", "platform": "cuda", "mesh": {"pipeline": 1, "data": 1, "fsdp": 2, "tensor": 1}},
               {"name": "rocm", "platform": "rocm", "mesh": {"pipeline": 1, "data": 1, "fsdp": 2, "tensor": 1}}]
    a, b = fake_run(tmp_path / "a", 3), fake_run(tmp_path / "b", 3, mesh={}, hetero={"islands": islands})
    r = compare.compare(a, b)
    assert r.platforms[0].endswith("mesh fsdp=8)"), r.platforms
    assert r.platforms[1].endswith("islands cuda (cuda, mesh fsdp=2) + rocm (rocm, mesh fsdp=2))"), r.platforms
    assert "one device" in compare.compare(fake_run(tmp_path / "c", 3, mesh={}), a).platforms[0]


@pytest.mark.parametrize("flag", ["--rtol", "--norm-rtol"])
@pytest.mark.parametrize("value", ["nan", "inf", "-1e-4"])
def test_a_tolerance_that_is_not_finite_or_negative_is_refused_naming_the_flag(flag, value, tmp_path, capsys,
                                                                                monkeypatch):
    """--rtol nan printed BIT-IDENTICAL for bit-identical runs and exited 1."""
    a, b = fake_run(tmp_path / "a", 3), fake_run(tmp_path / "b", 3)
    assert repro_main(["compare", str(a), str(b), f"{flag}={value}"]) == 2
    assert f"error: {flag}={float(value)}: a tolerance is a finite relative gap" in capsys.readouterr().err
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: pytest.fail("trained before refusing"))
    assert repro_main(["platforms", "--config", "tiny", "--platforms", "cpu,cpu", "--out", str(tmp_path / "o"),
                       f"{flag}={value}"]) == 2
    with pytest.raises(ConfigError, match=r"^rtol=nan"):
        compare.compare(a, b, rtol=math.nan)


@pytest.mark.parametrize("platforms", ["cpu,tpu", "tpu,gpu", "cpu", "cpu,cuda,rocm"])
def test_platforms_refuses_an_unknown_platform_before_anything_runs(platforms, tmp_path, monkeypatch, capsys):
    """--platforms cpu,tpu saved the initial weights and trained the CPU run before the tpu
    run failed, with exit 1."""
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: pytest.fail("ran before refusing"))
    assert repro_main(["platforms", "--config", "tiny", "--platforms", platforms, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"error: --platforms={platforms!r}: " in err, err
    if "tpu" in platforms:
        assert "'tpu' is not a platform with a profile; name two of cpu, cuda, rocm, gpu" in err, err
    assert not (tmp_path / "o").exists()
    with pytest.raises(ConfigError, match=r"platforms='tpu'"):  # the function, called directly
        platforms_lib.compare_platforms("tiny", {}, tmp_path / "o", ("cpu", "tpu"))


def test_the_check_table_says_dash_where_no_weights_were_compared(tmp_path):
    """init_equal None (no params step in common) printed DIFFER."""
    ref = fake_run(tmp_path / "ref", 3, params_at=(0,))
    late = fake_run(tmp_path / "late", 3, params_at=(2,))
    same = fake_run(tmp_path / "same", 3, params_at=(0,))
    rows = [check.Row("fsdp=8", ref, True, None), check.Row("late", late, True, compare.compare(ref, late)),
            check.Row("same", same, True, compare.compare(ref, same))]
    lines = check.table(rows, 1e-4, 1e-4).splitlines()
    assert "  step-0 weights  " in lines[0], lines[0]
    assert lines[3].split()[:3] == ["late", "same", "-"] and lines[4].split()[:3] == ["same", "same", "same"], lines


# ---------------------------------------------------------------------------
# End to end: real training runs (python -m hetjax.train in fresh processes).

SMALL = {"model.embed_dim": "32", "model.mlp_dim": "64", "model.num_kv_heads": "4", "seq_len": "32",
         "batch_size": "16", "eval_every": "0", "tensorboard": "false", "peak_tflops": "1",
         "data.num_documents": "2000", "steps": "20", "fingerprint_every": "10"}


@pytest.fixture
def small(tmp_path_factory):
    # One compilation cache for every run of this session (all xdist workers): the same
    # program compiles once.
    base = tmp_path_factory.getbasetemp()
    cache = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "repro_jax_cache"
    return {**SMALL, "compile.cache_dir": str(cache)}


def test_interleaved_pipeline_layout_agrees_with_the_unpipelined_run(tmp_path, small, capsys):
    layouts = "fsdp=8; pipeline=2,virtual_stages=2"  # 4 layers: 2 stages x 2 chunks of 1
    code, rows = check.check("tiny", layouts, tmp_path / "check", {**small, "model.num_layers": "4"}, steps=20)
    out = capsys.readouterr().out
    assert code == 0 and all(row.ok for row in rows), out
    report = rows[1].report
    assert report.init_equal and report.steps == list(range(20)) and report.within and not report.void, out
    assert "pipeline.virtual_stages=2" in (rows[1].run_dir / "train.log").read_text().splitlines()[0]


def train(run_dir, overrides, **extra):
    lay = check.Layout("fsdp=8", {"mesh.fsdp": "8", **{k: str(v) for k, v in extra.items()}}, 8)
    code = check.run(lay, "tiny", overrides, run_dir, "cpu", timeout=300)
    assert code == 0, (run_dir / "train.log").read_text()[-3000:]
    return run_dir


def test_layouts_agree_within_tolerance(tmp_path, small, capsys):
    layouts = "fsdp=8; fsdp=2,tensor=4; pipeline=2"
    if importlib.util.find_spec("hetjax.hetero") and importlib.util.find_spec("hetjax.hetero.layouts"):
        layouts += "; islands=2"
    code, rows = check.check("tiny", layouts, tmp_path / "check", small, steps=20)
    out = capsys.readouterr().out
    assert code == 0, out
    assert all(row.ok for row in rows) and len(rows) == len(layouts.split(";"))
    for row in rows[1:]:
        report = row.report
        assert report.first_data_diff is None and report.init_equal and report.init_step == 0, row.layout
        assert report.steps == list(range(20)) and report.within and not report.void, (row.layout, out)
        assert 0 <= report.max_loss_gap <= compare.LOSS_RTOL and row.layout in out
    first = read(rows[0].run_dir)
    assert first[0][0]["profile"] == "cpu-deterministic" and first[0][0]["mesh"]["fsdp"] == 8
    assert sorted(first[2]) == [0, 10, 20]


def test_the_same_config_twice_and_a_resumed_run_are_bit_identical(tmp_path, small):
    a = train(tmp_path / "a", small)
    b = train(tmp_path / "b", small, **{"checkpoint.every": 10})
    shutil.rmtree(b / "checkpoints" / "20")  # as if killed after step 10's checkpoint
    train(b, small, **{"checkpoint.every": 10})  # resumes at step 10
    headers, steps, params = read(b)
    assert [h["step"] for h in headers] == [0, 10] and sorted(steps) == list(range(20))
    superseded = [json.loads(l) for l in (b / "fingerprints.superseded.jsonl").read_text().splitlines()]
    assert min(r["step"] for r in superseded) == 10
    r = compare.compare(a, b)
    assert r.identical and r.code == 0 and r.max_loss_gap == 0.0, compare.describe(r)
    assert r.digests_equal == [0, 10, 20] and r.steps == list(range(20))
    assert repro_main(["compare", str(a), str(b)]) == 0 and (b / "compare.png").stat().st_size > 0
    # A plot that cannot be written leaves the verdict and its exit code alone.
    assert repro_main(["compare", str(a), str(b), "--plot", str(a / "fingerprints.jsonl" / "x.png")]) == 0

    # NaNs: the same NaN loss in both runs is a reproduced divergence, bit-identical; a NaN
    # tensor norm on one side is no longer skipped by max() into "within tolerance".
    def edited(name, edit):
        rows = [json.loads(l) for l in (a / "fingerprints.jsonl").read_text().splitlines()]
        for row in rows:
            edit(row)
        (tmp_path / name).mkdir()
        (tmp_path / name / "fingerprints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return tmp_path / name

    def nan_at_5(row):
        if row["kind"] == "step" and row["step"] >= 5:
            row["loss"] = row["grad_norm"] = math.nan

    def nan_norm(row):
        nan_at_5(row)
        if row["kind"] == "params" and row["step"] == 20:
            row["norms"][sorted(row["norms"])[0]] = math.nan

    r = compare.compare(edited("nan1", nan_at_5), edited("nan2", nan_at_5))
    assert r.identical and r.first_loss_diff is None and r.first_grad_norm_diff is None, compare.describe(r)
    r = compare.compare(edited("nan3", nan_at_5), edited("nan4", nan_norm))
    assert not r.within and r.max_norm_drift == math.inf, compare.describe(r)

    # A run killed (or diverged) after 2 of its 20 steps: its first steps agree, but the
    # steps it lacks cannot be judged, so the comparison is void, never "bit-identical".
    killed = edited("killed", lambda row: None)
    rows = [json.loads(l) for l in (killed / "fingerprints.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "header" or r["step"] < 2 or (r["kind"] == "params" and r["step"] == 0)]
    (killed / "fingerprints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for x, y, short in ((a, killed, "B"), (killed, a, "A")):
        r = compare.compare(x, y)
        assert r.code == compare.VOID and not r.identical, compare.describe(r)
        assert f"run {short} ends at step 1 (its config trains 20)" in r.void, r.void
    assert repro_main(["compare", str(a), str(killed)]) == compare.VOID

    # A run resumed with another learning rate: the config diff is the one it ended with.
    resumed = edited("resumed", lambda row: None)
    rows = [json.loads(l) for l in (resumed / "fingerprints.jsonl").read_text().splitlines()]
    header = json.loads(json.dumps(rows[0]))
    header["step"] = 10
    header["config"]["optim"]["learning_rate"] = 1e-3
    at = next(i for i, r in enumerate(rows) if r["kind"] == "step" and r["step"] == 10)
    (resumed / "fingerprints.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:at] + [header] + rows[at:]))
    assert compare.compare(a, resumed).config_diff == {"optim.learning_rate": (3e-3, 1e-3)}


def test_a_changed_learning_rate_or_data_seed_is_caught(tmp_path, small, capsys):
    base = train(tmp_path / "base", small)
    lr = train(tmp_path / "lr", small, **{"optim.learning_rate": 3.3e-3})  # tiny's is 3e-3
    seed = train(tmp_path / "seed", small, **{"data.seed": 1})

    # The first loss that can differ is that of the step after the first update whose
    # learning rate differs (warmup starts at 0, so step 0's updates are both zero).
    opt = load("tiny").optim
    sched_a = learning_rate_schedule(opt, 20)
    sched_b = learning_rate_schedule(dataclasses.replace(opt, learning_rate=3.3e-3), 20)
    first_lr = next(s for s in range(20) if float(sched_a(s)) != float(sched_b(s)))
    r = compare.compare(base, lr)
    assert not r.void and r.first_data_diff is None and r.init_equal
    assert r.first_loss_diff == first_lr + 1, compare.describe(r)
    assert r.code == compare.OUT_OF_TOLERANCE and r.max_loss_gap > 10 * compare.LOSS_RTOL
    assert r.config_diff == {"optim.learning_rate": (3e-3, 3.3e-3)}
    assert repro_main(["compare", str(base), str(lr), "--plot", str(tmp_path / "lr.png")]) == 1
    assert "OUT OF TOLERANCE" in capsys.readouterr().out and (tmp_path / "lr.png").exists()

    # The first step whose global batch differs, found from the data pipeline itself.
    sources = [data.build(load("tiny", {**SMALL, "data.seed": str(s)})).train for s in (0, 1)]
    rows = lambda src, s: src.rows(s * 16 + np.arange(16))  # noqa: E731
    first_data = next(s for s in range(20) if any(not np.array_equal(rows(sources[0], s)[k], rows(sources[1], s)[k])
                                                  for k in rows(sources[0], s)))
    r = compare.compare(base, seed)
    assert r.void and "data differ" in r.void and r.first_data_diff == first_data
    assert repro_main(["compare", str(base), str(seed)]) == compare.VOID
    assert f"FIRST DIFFERS AT STEP {first_data}" in capsys.readouterr().out


def test_platforms_trains_from_one_saved_start_and_its_children_keep_the_callers_pythonpath(
        tmp_path, monkeypatch, capsys):
    # Packages installed beside the checkout (pip --target, as on a GPU machine with no
    # index) reach each child only through PYTHONPATH: a sitecustomize there marks each start.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, pathlib\n"
        f"pathlib.Path({str(tmp_path / 'marks')!r}, str(os.getpid())).touch()\n")
    (tmp_path / "marks").mkdir()
    monkeypatch.setenv("PYTHONPATH", str(site))
    assert check.python_path().split(os.pathsep) == [str(check.ROOT), str(site)]
    # Two CPU runs stand in for CPU and a GPU: the same platform twice must be bit-identical.
    code = repro_main(["platforms", "--config", "tiny", "--platforms", "cpu,cpu", "--steps", "3",
                       "--fingerprint-every", "1", "--out", str(tmp_path / "out"),
                       "--config.eval_every=0", "--config.tensorboard=false"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "parameters at step 0: identical" in out and "BIT-IDENTICAL" in out, out
    assert len(list((tmp_path / "marks").iterdir())) == 3, out  # init and both runs
