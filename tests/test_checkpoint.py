"""Checkpoints: exact resume after SIGKILL/SIGTERM, resharding restore, damage, full disk."""

import asyncio
import dataclasses
import gc
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from hetjax import checkpoint, checkpoint_init, data, orbax_noise, step, train
from hetjax import config as config_lib
from hetjax.compile import aot
from hetjax.repro import digest
from hetjax import state as state_lib
from hetjax.config import CheckpointConfig, ConfigError, MeshConfig
from hetjax.mesh import make_mesh
from hetjax.optim import make_optimizer
from tests.test_sharding import CFG, build

ROOT = Path(__file__).resolve().parent.parent
ENV = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT),
       "XLA_FLAGS": os.environ["XLA_FLAGS"]}  # conftest's: 8 devices, compiled as in this process
STEPS = 40  # SIGTERM lands at step 8: the steps left keep a slow test runner from missing the run
TRAIN_ARGS = ["--config", "tiny.py", f"--config.steps={STEPS}", "--config.checkpoint.every=3",
              "--config.eval_every=0", "--config.tensorboard=false", "--config.log_every=1",
              "--config.mesh.data=2", "--config.mesh.fsdp=4", "--config.model.embed_dim=32",
              "--config.model.mlp_dim=64", "--config.peak_tflops=1"]


def rows(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def start(run_dir):
    return subprocess.Popen([sys.executable, "-m", "hetjax.train", *TRAIN_ARGS, f"--config.run_dir={run_dir}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_step(proc, run_dir, k, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.exists() and any(f'"step": {k},' in l for l in path.read_text().splitlines()):
            return
        if proc.poll() is not None:
            pytest.fail(f"training exited early: {proc.stdout.read()}")
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"step {k} did not appear in {timeout}s")


def test_sigkill_and_sigterm_then_resume_give_the_same_losses_bit_for_bit(tmp_path):
    reference = tmp_path / "reference"
    assert train.main([*TRAIN_ARGS, f"--config.run_dir={reference}"]) == 0
    expected = [r["loss"] for r in rows(reference)]
    assert len(expected) == STEPS

    run = tmp_path / "run"
    kill_at = random.Random().randrange(2, 7)  # any step; the kill may land inside an async save
    proc = start(run)
    wait_for_step(proc, run, kill_at)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    committed = checkpoint.Manager(run / "checkpoints", read_only=True).steps()

    proc = start(run)  # same run_dir, no flag: resumes
    wait_for_step(proc, run, 8)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == train.PREEMPTED, out
    assert not committed or f"resumed from step {max(committed)}" in out, (committed, out)
    assert "preempted (SIGTERM): saved step" in out, out
    preempted_at = int(out.split("preempted (SIGTERM): saved step ")[1].split()[0])
    # SIGTERM saves where it lands: the state after the last step logged, not the next scheduled save
    assert max(r["step"] for r in rows(run)) == preempted_at - 1, (preempted_at, out)
    assert preempted_at in checkpoint.Manager(run / "checkpoints", read_only=True).steps()

    assert train.main([*TRAIN_ARGS, f"--config.run_dir={run}"]) == 0
    got = rows(run)
    assert [r["step"] for r in got] == list(range(STEPS)), f"killed at step {kill_at}"
    assert [r["loss"] for r in got] == expected, f"killed at step {kill_at}"
    # Rows recomputed after the kill were kept aside, not lost.
    assert (run / "metrics.superseded.jsonl").exists() or kill_at % 3 == 2


def start_long(run_dir):
    """A run that would go on for hours, with TensorBoard on (its writer's thread must not
    hold the exit); stdout and stderr apart, read line by line."""
    args = [a for a in TRAIN_ARGS if not a.startswith(("--config.steps", "--config.tensorboard"))]
    return subprocess.Popen([sys.executable, "-m", "hetjax.train", *args, "--config.steps=100000",
                             "--config.tensorboard=true", f"--config.run_dir={run_dir}"],
                            cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_until(proc, prefix):
    lines = []
    while not (lines and lines[-1].startswith(prefix)):
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"exited before a line starting {prefix!r}: {''.join(lines)}{proc.stderr.read()}")
        lines.append(line)
    return "".join(lines)


def test_ctrl_c_saves_a_checkpoint_and_exits_130_with_one_line(tmp_path):
    proc = start_long(tmp_path / "run")
    before = read_until(proc, "step 0:")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, before + out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = out.strip().splitlines()[-1]
    assert last.startswith("interrupted (Ctrl-C): saved step ") and out.count("interrupted") == 1, out
    saved = int(last.split("saved step ")[1].split()[0])
    assert saved in checkpoint.Manager(tmp_path / "run" / "checkpoints", read_only=True).steps()


def test_a_second_ctrl_c_exits_at_once(tmp_path):
    proc = start_long(tmp_path / "run")
    read_until(proc, "tiny: ")  # the job is being built: the step compiles next
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)  # two deliveries, not one merged signal
    proc.send_signal(signal.SIGINT)
    t = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - t < 10, "the second Ctrl-C waited for something"
    assert proc.returncode == 130, out + err
    assert err.strip().splitlines()[-1].startswith("interrupted twice (Ctrl-C): exiting at once"), err
    assert "Traceback" not in err and "saved step" not in out, out + err


def save_state(directory, mesh_cfg, n, steps=(2,), cfg=CFG, **ckpt):
    mesh, rules, tx, graphdef, shardings, state = build(cfg, mesh_cfg, n)
    manager = checkpoint.Manager(directory, CheckpointConfig(async_save=False, **ckpt))
    for s in steps:
        manager.save(s, state, {"step": s}, {"model": dataclasses.asdict(cfg.model)})
    manager.close()
    return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints of steps 2 and 4 written on fsdp=8, and the state they hold."""
    directory = tmp_path_factory.mktemp("saved") / "ck"
    state = save_state(directory, MeshConfig(fsdp=8), 8, steps=(2, 4))
    return directory, state


def abstract_for(mesh_cfg, n, cfg=CFG):
    mesh = make_mesh(mesh_cfg, jax.devices()[:n])
    _, abstract = state_lib.abstract_state(cfg.model, cfg.seed, make_optimizer(cfg.optim, cfg.steps))
    return abstract, state_lib.state_shardings(abstract, mesh, cfg.sharding.rules)


def test_restore_onto_other_meshes_reshards_without_gathering(saved):
    directory, saved = saved
    want = jax.device_get(saved)
    prints = []
    for mesh_cfg, n in [(MeshConfig(fsdp=2, tensor=4), 8), (MeshConfig(fsdp=1), 1)]:
        abstract, shardings = abstract_for(mesh_cfg, n)
        restored = checkpoint.Manager(directory, read_only=True).restore_latest(abstract, shardings)
        assert restored.step == 4 and restored.data_state == {"step": 4}
        got = restored.state
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(got.params), want.params)
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(got.opt_state), want.opt_state)
        for x, s in zip(jax.tree.leaves(got.params), jax.tree.leaves(shardings.params)):
            assert x.sharding == s  # each device holds only its shard
            assert x.addressable_shards[0].data.shape == s.shard_shape(x.shape)
        prints.append(digest.params_checksum(got.params))
    assert prints == [digest.params_checksum(saved.params)] * 2 == [restored.meta["params_checksum"]] * 2


def test_fingerprint_sees_one_flipped_bit_and_ignores_layout():
    tree = {"a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(5, np.int32)}
    base = digest.params_checksum(tree)
    flipped = tree["a"].copy()
    flipped.view(np.uint32)[1, 2] ^= 1
    assert digest.params_checksum({**tree, "a": flipped}) != base
    swapped = tree["a"].copy()
    swapped[0, 0], swapped[0, 1] = swapped[0, 1], swapped[0, 0]
    assert digest.params_checksum({**tree, "a": swapped}) != base
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded = jax.device_put(np.tile(tree["a"], (8, 1)), jax.NamedSharding(mesh, jax.P("x")))
    assert digest.leaf_checksums([sharded]) == digest.leaf_checksums([np.tile(tree["a"], (8, 1))])


def damage_params(step_dir: Path, damage: str) -> None:
    """Truncates (to half, or to a twentieth: "truncate-most") or zeroes 16 bytes in the
    middle of the largest parameter file; or edits the saved data state ("data": the step
    its batches resume at) or config ("config": a model field) as text, leaving valid JSON."""
    if damage in ("data", "config"):
        item = step_dir / damage / "metadata"
        text = item.read_text()
        edited = (text.replace('"step": 4', '"step": 3') if damage == "data"
                  else text.replace('"num_layers": 2', '"num_layers": 3'))
        assert edited != text, text
        item.write_text(edited)
        return
    files = sorted((p for p in (step_dir / "params").rglob("*") if p.is_file() and p.stat().st_size > 64),
                   key=lambda p: -p.stat().st_size)
    victim = files[0]
    if damage.startswith("truncate"):
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // (20 if damage == "truncate-most" else 2)])
    else:
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2: len(raw) // 2 + 16] = bytes(16)
        victim.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["truncate", "overwrite", "data", "config"])
def test_a_damaged_latest_checkpoint_is_reported_and_skipped(tmp_path, damage, saved):
    """Also its JSON items: a data state edited to another step failed an assertion on
    every start (or, under python -O, resumed on other batches), never set aside."""
    shutil.copytree(saved[0], tmp_path / "ck")
    saved = saved[1]
    damage_params(tmp_path / "ck" / "4", damage)
    count = sum(1 for p in (tmp_path / "ck").rglob("*") if p.is_file())
    abstract, shardings = abstract_for(MeshConfig(fsdp=8), 8)
    log = []
    restored = checkpoint.Manager(tmp_path / "ck").restore_latest(abstract, shardings, log=log.append)
    assert restored.step == 2, log
    assert any("step 4" in l and ("damaged" in l or "unreadable" in l) for l in log), log
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.state.params), jax.device_get(saved.params))
    # Nothing deleted: the damaged step moved to corrupt/, every file still there (orbax's
    # late reports of the abandoned reads may add ck.errors.log beside them).
    assert sum(1 for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".errors.log")) == count
    assert [p.name.split("-")[1] for p in (tmp_path / "corrupt").iterdir()] == ["4"]


def test_a_run_whose_every_checkpoint_fails_stops_instead_of_starting_again(tmp_path, saved, monkeypatch):
    """Every step damaged: each is set aside, and the start stops, saying so, where it used
    to go on from step 0 as if nothing had been saved. A read that runs out of memory is not
    damage: it stops the start and moves nothing (it used to move every step aside)."""
    abstract, shardings = abstract_for(MeshConfig(fsdp=8), 8)
    shutil.copytree(saved[0], tmp_path / "oom")
    import orbax.checkpoint as ocp
    real = ocp.CheckpointManager.restore

    def exhausted(self, step, *a, args=None, **k):
        if args is not None and "params" in args.keys():
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.00GiB")
        return real(self, step, *a, args=args, **k)
    with monkeypatch.context() as m:
        m.setattr(ocp.CheckpointManager, "restore", exhausted)
        with pytest.raises(checkpoint.CheckpointError, match=r"step 4 .* ran out of memory .* nothing was moved"):
            checkpoint.Manager(tmp_path / "oom").restore_latest(abstract, shardings)
    assert sorted(p.name for p in (tmp_path / "oom").iterdir() if p.name.isdigit()) == ["2", "4"]
    assert not (tmp_path / checkpoint.CORRUPT_DIR).exists()

    shutil.copytree(saved[0], tmp_path / "ck")
    for step in ("2", "4"):
        damage_params(tmp_path / "ck" / step, "overwrite")
    log = []
    with pytest.raises(checkpoint.CheckpointError, match=r"none of the 2 checkpoints .* could be read"):
        checkpoint.Manager(tmp_path / "ck").restore_latest(abstract, shardings, log=log.append)
    assert sorted(p.name.split("-")[1] for p in (tmp_path / checkpoint.CORRUPT_DIR).iterdir()) == ["2", "4"]
    assert checkpoint.Manager(tmp_path / "ck").restore_latest(abstract, shardings) is None  # the next start: step 0


def abandoned_tasks() -> int:
    """Tasks pending on a closed event loop: what a failed orbax restore leaves behind."""
    return sum(1 for o in gc.get_objects() if issubclass(type(o), asyncio.Task) and not o.done()
               and o.get_loop().is_closed())


def test_a_damaged_checkpoint_leaves_no_abandoned_reads_behind(tmp_path, saved, monkeypatch):
    """orbax abandons its other reads when one fails: each used to raise the damage again
    when collected, later, in whichever code ran then (~100 tracebacks a restore, about
    one restore in three). Left alone, whether a read is still in flight when the damaged one
    fails is a race (a CI run on a slower machine saw none in 30 restores), so the disk is
    made slow here: a sound read stays in flight 0.2 s after its bytes arrive, a damaged one
    fails at once. Restores until two did abandon reads, so that it is tested."""
    from orbax.checkpoint._src.serialization import serialization as orbax_serialization
    read = orbax_serialization._read_shard

    async def slow_when_sound(**kwargs):
        shard = await read(**kwargs)
        await asyncio.sleep(0.2)
        return shard
    monkeypatch.setattr(orbax_serialization, "_read_shard", slow_when_sound)
    abstract, shardings = abstract_for(MeshConfig(fsdp=8), 8)
    close, seen = orbax_noise.close_abandoned_tasks, []

    def counting(error):
        seen.append(abandoned_tasks())
        close(error)
    monkeypatch.setattr(orbax_noise, "close_abandoned_tasks", counting)
    caught = []
    hook, sys.unraisablehook = sys.unraisablehook, caught.append
    try:
        for i in range(30):
            shutil.copytree(saved[0], tmp_path / f"ck{i}")
            damage_params(tmp_path / f"ck{i}" / "4", "truncate-most")
            manager = checkpoint.Manager(tmp_path / f"ck{i}", read_only=True)
            try:
                assert manager.restore_latest(abstract, shardings, log=lambda _: None).step == 2
            finally:
                manager.close()
            if sum(n > 0 for n in seen) >= 2:
                break
        time.sleep(0.5)  # reads still in flight end
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert sum(n > 0 for n in seen) >= 2, f"orbax abandoned no reads in {len(seen)} failed restores: {seen}"
    assert not caught, [f"{u.object!r}: {u.exc_value!r}"[:200] for u in caught[:3]]
    assert abandoned_tasks() == 0


def test_load_params_skips_a_damaged_checkpoint_and_keeps_it(tmp_path, saved):
    """init_from reads parameters through the same verified path as a resume."""
    shutil.copytree(saved[0], tmp_path / "ck")
    damage_params(tmp_path / "ck" / "4", "overwrite")
    abstract, shardings = abstract_for(MeshConfig(fsdp=2, tensor=4), 8)
    log = []
    params = checkpoint_init.load_params(tmp_path / "ck", abstract.params, shardings.params, log=log.append)
    assert any("step 4" in l and ("damaged" in l or "unreadable" in l) for l in log) and "step 2" in log[-1], log
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(saved[1].params))
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings.params)))
    assert (tmp_path / "ck" / "4").is_dir()  # init_from reads; it moves nothing aside
    with pytest.raises(checkpoint.CheckpointError, match="no readable checkpoint"):
        checkpoint_init.load_params(tmp_path / "ck" / "4", abstract.params, shardings.params, log=log.append)


def test_a_shape_mismatch_names_the_parameter(saved):
    other = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, mlp_dim=128))
    abstract, shardings = abstract_for(MeshConfig(fsdp=8), 8, other)
    with pytest.raises(ConfigError, match=r"'blocks/mlp/down_FD' has shape \(2, 64, 32\) there but \(2, 128, 32\)"):
        checkpoint.Manager(saved[0], read_only=True).restore_latest(abstract, shardings)
    assert (saved[0] / "4").is_dir()  # a config mistake never moves a checkpoint


FULL_DISK = textwrap.dedent("""
    import json, os, resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, os.getcwd())
    import jax
    from hetjax import checkpoint
    from hetjax.repro import digest
    from hetjax.config import CheckpointConfig, MeshConfig
    from tests.test_sharding import CFG, build
    from tests.test_checkpoint import abstract_for
    directory, how = Path(sys.argv[1]), sys.argv[2]
    _, _, _, _, shardings, state = build(CFG, MeshConfig(fsdp=1), 1)
    manager = checkpoint.Manager(directory, CheckpointConfig(every=2))
    manager.save(2, state, {"step": 2}, {})
    manager.wait()
    if how == "full":  # the kernel refuses writes past 2 KiB, as a full disk would
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
    else:
        os.chmod(directory, 0o500)
    try:
        manager.save(4, state, {"step": 4}, {})
        manager.wait()
        error = None
    except checkpoint.CheckpointError as e:
        error = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    os.chmod(directory, 0o700)
    abstract, shardings = abstract_for(MeshConfig(fsdp=1), 1)
    restored = checkpoint.Manager(directory).restore_latest(abstract, shardings, log=print)
    print(json.dumps({"error": error, "restored": restored.step,
                      "same": digest.params_checksum(restored.state.params) == digest.params_checksum(state.params)}))
""")


@pytest.mark.parametrize("how", ["full", "unwritable"])
def test_a_failed_save_is_loud_and_keeps_the_previous_checkpoint(tmp_path, how):
    if how == "unwritable" and os.geteuid() == 0:
        pytest.skip("running as root: permissions do not stop writes (the full-disk case covers the failure)")
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "ck"), how], cwd=ROOT,
                          env={**ENV, "XLA_FLAGS": ""}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["error"] and "saving checkpoint step 4" in result["error"], result
    assert "step 2) is untouched" in result["error"]
    # The cause orbax wrapped (or only logged) is named, with the hint that fits it.
    cause, hint = {"full": ("File too large", "Free disk space"),
                   "unwritable": ("Permission denied", "Fix the permissions")}[how]
    assert cause in result["error"] and hint in result["error"], result
    assert result["restored"] == 2 and result["same"], result


def test_training_on_a_full_disk_exits_with_the_cause_in_one_line(tmp_path):
    # In the child: writes past 20 KiB fail, as on a full disk (set by a shell, not a
    # preexec_fn: forking this multithreaded process draws jax's deadlock warning).
    full_disk = ["bash", "-c", "trap '' XFSZ; ulimit -f 20; exec \"$@\"", "bash"]
    args = [a for a in TRAIN_ARGS if not a.startswith("--config.steps")]
    # (jax's compilation cache off: its own warnings about the full disk are not the point here)
    proc = subprocess.run([*full_disk, sys.executable, "-m", "hetjax.train", *args, "--config.steps=6",
                           "--config.compile.cache=false", f"--config.run_dir={tmp_path / 'run'}"], cwd=ROOT,
                          env={**ENV, "PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True,
                          timeout=300)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1 and len(ours) == 1, (ours, proc.returncode, proc.stderr[-3000:])
    last = ours[0]
    assert last.startswith("error: saving checkpoint step 3 "), last
    assert "File too large" in last and "Free disk space" in last and "no earlier checkpoint" in last, last
    assert not (tmp_path / "run" / "checkpoints" / "3").exists()
    # orbax's ~100 tracebacks about the same failure (its threads' logs, and "Event loop is
    # closed" from writes that finish after it) went to a file, named in our line. The
    # limit holds for that file too: once it is full, the first report no file kept comes
    # to the console, then one line saying the rest are not kept.
    reports = [line for line in proc.stderr.splitlines()  # the first line of each of orbax's reports
               if line.startswith(("ERROR:absl:", "E0", "E1", "Exception ignored"))]
    assert len(reports) <= 1, proc.stderr[-3000:]
    assert not reports or "orbax's further reports of this failure are not kept" in proc.stderr, proc.stderr[-3000:]
    log = tmp_path / "run" / "checkpoints.errors.log"
    assert f"(orbax's reports: {log})" in last and "Traceback" in log.read_text(), last


def test_an_unusable_checkpoint_dir_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(checkpoint.CheckpointError, match="config.checkpoint.dir"):
        checkpoint.Manager(tmp_path / "file" / "ck")


def test_a_changed_optimizer_is_a_config_error_that_moves_no_checkpoint(saved):
    """Clipping off: optax's chain loses a part, so orbax cannot read the saved optimizer
    state; that is the config's doing, not damage, and the checkpoints stay where they are."""
    other = dataclasses.replace(CFG, optim=dataclasses.replace(CFG.optim, grad_clip_norm=0.0))
    abstract, shardings = abstract_for(MeshConfig(fsdp=8), 8, other)
    moved = []
    with pytest.raises(ConfigError, match=r"checkpoint step 4 .* its optimizer state \(\d+ arrays\) is not the "
                                          r"one this config's optimizer makes .*config.optim changed"):
        checkpoint.Manager(saved[0], read_only=True).restore_latest(abstract, shardings, log=moved.append)
    assert not moved and (saved[0] / "4").is_dir() and (saved[0] / "2").is_dir()


def test_a_tool_writing_into_a_checkpoint_directory_deletes_no_step(tmp_path):
    from hetjax.hetero import checkpoints as island_checkpoints
    cfg = dataclasses.replace(CFG, checkpoint=dataclasses.replace(CFG.checkpoint, keep=2))
    state = save_state(tmp_path / "ck", MeshConfig(fsdp=8), 8, steps=(10, 20), cfg=cfg, keep=2)
    for step in (30, 5):
        island_checkpoints.save_state(cfg, state, {"step": step}, tmp_path / "ck", step)
    assert checkpoint.Manager(tmp_path / "ck", read_only=True).steps() == [5, 10, 20, 30]


def test_init_from_starts_a_new_run_from_saved_weights(tmp_path, saved, monkeypatch):
    m = CFG.model
    args = ["--config", "tiny.py", "--config.steps=1", "--config.eval_every=0", "--config.tensorboard=false",
            "--config.mesh.fsdp=8", "--config.peak_tflops=1", f"--config.batch_size={CFG.batch_size}",
            f"--config.seq_len={CFG.seq_len}", "--config.model.rope_theta=500000", "--config.data.branching=4",
            *[f"--config.model.{k}={getattr(m, k)}" for k in (
                "vocab_size", "num_layers", "embed_dim", "mlp_dim", "num_heads", "num_kv_heads", "head_dim",
                "qkv_bias")]]
    assert train.main([*args, f"--config.run_dir={tmp_path / 'b'}", f"--config.init_from={saved[0]}"]) == 0
    # The new run's first loss is the saved weights' loss on batch 0 (plain jit, no mesh).
    cfg = train.config_lib.load("tiny.py", {a[9:].split("=")[0]: a.split("=")[1] for a in args[2:]})
    graphdef = state_lib.abstract_state(cfg.model, cfg.seed, make_optimizer(cfg.optim, 1))[0]
    batch = data.build(cfg).train.rows(np.arange(cfg.batch_size))  # step 0's rows
    loss_sum, count = jax.jit(step.loss_sums, static_argnums=1)(jax.device_get(saved[1].params), graphdef, batch)
    np.testing.assert_allclose(rows(tmp_path / "b")[0]["loss"], float(loss_sum / count), rtol=1e-5)
    abstract, shardings = abstract_for(MeshConfig(fsdp=8), 8, cfg)
    restored = checkpoint.Manager(tmp_path / "b" / "checkpoints", read_only=True).restore(1, abstract, shardings)
    counts = [int(x) for p, x in jax.tree_util.tree_flatten_with_path(restored.state.opt_state)[0]
              if "count" in jax.tree_util.keystr(p)]
    assert counts and set(counts) == {1}  # a fresh optimizer: one update
    with pytest.raises(ConfigError, match="config.init_from"):
        train.main([*args, f"--config.run_dir={tmp_path / 'c'}", f"--config.init_from={tmp_path / 'nope'}"])
    # A run that has its own checkpoints resumes them, its init_from gone (a requeued
    # fine-tune whose source was purged was refused: "no such file or directory").
    shutil.copytree(saved[0], tmp_path / "src" / "checkpoints")
    start_from = [*args, f"--config.run_dir={tmp_path / 'g'}", f"--config.init_from={tmp_path / 'src'}"]
    assert train.main(start_from) == 0
    shutil.rmtree(tmp_path / "src")
    assert train.main([*start_from, "--config.steps=2"]) == 0 and len(rows(tmp_path / "g")) == 2
    # A checkpoint of another shape, to start from or to resume, is refused from its metadata
    # before the step compiles (it used to be read, and refused, after a full compile).
    def no_compile(*a, **k):
        raise AssertionError("compiled before refusing the checkpoint")
    monkeypatch.setattr(aot, "compile", no_compile)
    wider = [a for a in args if "mlp_dim" not in a] + ["--config.model.mlp_dim=128"]
    with pytest.raises(ConfigError, match=r"'blocks/mlp/down_FD' has shape \(2, 64, 32\) there but \(2, 128, 32\)"):
        train.main([*wider, f"--config.run_dir={tmp_path / 'e'}", f"--config.init_from={saved[0]}"])
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)  # a run that saved nothing: refused after compiling
    with pytest.raises(ConfigError, match=r"config.init_from=.*empty': .*checkpoints holds no checkpoint step"):
        train.main([*args, f"--config.run_dir={tmp_path / 'h'}", f"--config.init_from={tmp_path / 'empty'}"])
    shutil.copytree(saved[0], tmp_path / "f" / "checkpoints")
    with pytest.raises(ConfigError, match=r"checkpoint step 4 .* 'blocks/mlp/down_FD' has shape"):
        train.main([*wider, f"--config.run_dir={tmp_path / 'f'}", "--config.steps=6"])
    (tmp_path / "model.safetensors").write_bytes(b"not a checkpoint directory")
    with pytest.raises(ConfigError, match="config.init_from=.*model.safetensors' holds no checkpoint"):
        train.main([*args, f"--config.run_dir={tmp_path / 'd'}", f"--config.init_from={tmp_path / 'model.safetensors'}"])


def test_opening_checkpoints_read_only_logs_no_warning(tmp_path, caplog):
    # orbax warns on each read-only open (that saving is off, that the directory is read
    # only); every init_from, export and restore opens one, and the user can do nothing about it.
    import logging
    with caplog.at_level(logging.WARNING):
        checkpoint.Manager(tmp_path, read_only=True).close()
    assert not [r for r in caplog.records if "read only" in r.getMessage() or "read_only" in r.getMessage()]


def test_orbax_reports_survive_a_reset_hook_and_an_unwritable_file(tmp_path, capsys, monkeypatch):
    """The divert comes back after a test runner resets sys.unraisablehook; a report that no
    file can keep reaches the console once; a closed loop's task that is not orbax's is
    left alone."""
    import logging
    monkeypatch.setattr(orbax_noise, "_open", [])  # other tests' Managers take no part
    monkeypatch.setattr(orbax_noise, "_unkept", 0)
    (tmp_path / "full").mkdir()
    reports = orbax_noise.Reports(tmp_path / "full" / "x" / "ck")  # its file's directory does not exist
    hook = sys.unraisablehook
    try:
        sys.unraisablehook = sys.__unraisablehook__
        reports.start()
        assert getattr(sys.unraisablehook, "hetjax_divert", False)
        record = logging.LogRecord("absl", logging.ERROR, "/x/orbax/y.py", 1, "boom %d", (1,), None)
        assert orbax_noise._to_reports(record) and not orbax_noise._to_reports(record)  # the first only
        assert "further reports of this failure are not kept" in capsys.readouterr().err
        reports.path = tmp_path / "ck.errors.log"
        assert not orbax_noise._to_reports(record) and "boom 1" in reports.path.read_text()
    finally:
        reports.stop()
        sys.unraisablehook = hook

    async def not_orbax():
        await asyncio.sleep(3600)
    loop = asyncio.new_event_loop()
    task = loop.create_task(not_orbax())
    loop.call_soon(loop.stop)
    loop.run_forever()
    loop.close()
    orbax_noise.close_abandoned_tasks(RuntimeError("x"))
    assert task.get_coro().cr_frame is not None  # not closed
    task._log_destroy_pending = False
    task.get_coro().close()


@pytest.mark.parametrize("config,folders,match", [
    ("tiny.py", ("cuda/3", "rocm/3"), r"holds an islands job's checkpoints \(cuda, rocm\), and this config has no islands"),
    ("tiny_hetero.py", ("3",), r"holds a one-mesh job's checkpoints \(steps \[3\]\), and this config runs islands"),
    ("tiny_hetero.py", ("cuda/3", "mi300/3"), r"holds checkpoints of islands \['mi300'\]")],
    ids=["one-mesh-over-islands", "islands-over-one-mesh", "renamed-island"])
def test_a_run_dir_of_another_kind_of_job_is_refused_before_anything_is_written(tmp_path, config, folders, match):
    """Before, neither kind found the other's checkpoints: the job trained from step 0 and
    rewrote the run's metrics."""
    run_dir = tmp_path / "run"
    for f in folders:
        (run_dir / "checkpoints" / f).mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 5.5}\n')
    with pytest.raises(ConfigError, match=match):
        train.main(["--config", config, f"--config.run_dir={run_dir}", "--config.steps=2"])
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0, "loss": 5.5}\n'
    assert sorted(str(p.relative_to(run_dir / "checkpoints")) for p in (run_dir / "checkpoints").rglob("*")) == \
        sorted({*folders, *(f.split("/")[0] for f in folders)})


def test_a_start_is_checked_against_the_config_its_run_last_wrote(tmp_path):
    """Its custom checkpoint.dir left out, a run started from step 0 and rewrote its
    metrics; resumed with more config.steps, its learning rate jumped without a word."""
    from hetjax import checkpoint_fit
    run_dir, elsewhere = tmp_path / "run", tmp_path / "ckpts"
    (elsewhere / "20").mkdir(parents=True)
    (run_dir / "metrics.jsonl").parent.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "loss": 5.5}\n')
    config_lib.save(dataclasses.replace(CFG, run_dir=str(run_dir), steps=20, checkpoint=dataclasses.replace(
        CFG.checkpoint, dir=str(elsewhere))), run_dir / "config.json")
    with pytest.raises(ConfigError, match=rf"config.json says this run's checkpoints are in {elsewhere} \(steps up "
                                          rf"to 20\), but this start looks in {run_dir / 'checkpoints'} .*"
                                          rf"--config.checkpoint.dir={elsewhere} to resume"):
        train.main(["--config", "tiny.py", f"--config.run_dir={run_dir}", "--config.steps=30"])
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 0, "loss": 5.5}\n'
    said = []
    cfg = dataclasses.replace(CFG, run_dir=str(run_dir), steps=30, checkpoint=dataclasses.replace(
        CFG.checkpoint, dir=str(elsewhere)))
    assert checkpoint_fit.check_resume(cfg, said.append) == [20]
    assert said == ["warning: resuming at step 20 with config.steps=30: the learning rate's cosine now ends at step 30 "
                    "where this run's ended at 20, so the rate jumps at the resume; --config.optim.decay_steps=20 "
                    "keeps the run's schedule"]
    kept = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, decay_steps=20))
    assert checkpoint_fit.check_resume(kept, said.append) == [20] and len(said) == 1
    with pytest.raises(ConfigError, match=r"keep_every=15 is not a multiple of config.checkpoint.every=10: .*\(e.g. 20\)"):
        config_lib.validate(dataclasses.replace(CFG, checkpoint=dataclasses.replace(CFG.checkpoint, every=10,
                                                                                     keep_every=15)))


def test_a_checkpoint_of_another_param_dtype_is_verified_as_saved_then_cast(tmp_path):
    """A bfloat16 import read by a float32 run (llama8b's), or a run resumed with another
    param_dtype: its checksums are of the saved bits. Before, the arrays were cast first and
    every step was then reported damaged and moved aside."""
    bf16 = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, param_dtype="bfloat16"))
    state = save_state(tmp_path / "ck", MeshConfig(fsdp=8), 8, steps=(2,), cfg=bf16)
    want = jax.tree.map(lambda x: np.asarray(x).astype(np.float32), jax.device_get(state.params))
    abstract, shardings = abstract_for(MeshConfig(fsdp=8), 8)  # float32
    assert {x.dtype for x in jax.tree.leaves(abstract.params)} == {np.dtype("float32")}
    restored = checkpoint.Manager(tmp_path / "ck", read_only=True).restore_latest(abstract, shardings)
    assert restored is not None and restored.step == 2
    for got, w, s in zip(jax.tree.leaves(restored.state.params), jax.tree.leaves(want), jax.tree.leaves(shardings.params)):
        assert got.dtype == np.float32 and got.sharding == s
        np.testing.assert_array_equal(np.asarray(got), w)
    params = checkpoint_init.load_params(tmp_path / "ck", abstract.params, shardings.params)
    jax.tree.map(lambda got, w: np.testing.assert_array_equal(np.asarray(got), w), params, want)
    assert not (tmp_path / checkpoint.CORRUPT_DIR).exists()
