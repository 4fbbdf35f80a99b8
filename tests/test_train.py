"""The train step and the training program, end to end on 8 virtual CPU devices."""

import dataclasses
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax import config as config_lib, program
from hetjax import data, step, train
from hetjax.compile import aot
from hetjax.config import Config, MeshConfig, ModelConfig, OptimConfig
from hetjax.errors import TrainingDiverged
from hetjax.mesh import make_mesh
from hetjax.optim import decay_mask, learning_rate_schedule, make_optimizer
from tests.test_sharding import build

ROOT = Path(__file__).resolve().parent.parent
CFG = Config(
    model=ModelConfig(vocab_size=64, num_layers=2, embed_dim=32, mlp_dim=64, num_heads=4,
                      num_kv_heads=2, head_dim=8),
    mesh=MeshConfig(data=2, fsdp=4),
    optim=OptimConfig(learning_rate=1e-2, warmup_steps=1),
    batch_size=8, seq_len=16, steps=3)


def make_step(cfg, jit=True):
    mesh, rules, tx, graphdef, shardings, state = build(cfg, cfg.mesh, 8)
    fn = step.make_train_step(graphdef, tx, learning_rate_schedule(cfg.optim, cfg.steps), mesh,
                              rules, cfg.optim.grad_accum_steps)
    batch_sh = program.batch_shardings(mesh, rules)
    stream = data.build(cfg)
    batches = [stream.batch(s, batch_sh) for s in range(cfg.steps)]
    return fn, shardings, batch_sh, mesh, state, batches


def test_the_step_is_traced_once():
    fn, shardings, batch_sh, mesh, state, batches = make_step(CFG)
    traces = []

    def counted(state, batch):
        traces.append(1)
        return fn(state, batch)

    jitted = program.jit_train_step(counted, shardings, batch_sh, mesh)
    for batch in batches:
        state, _ = jitted(state, batch)
    assert len(traces) == 1 and jitted._cache_size() == 1
    assert int(state.step) == len(batches)


def test_gradient_accumulation_changes_memory_not_the_result():
    results = []
    for accum in (1, 4):  # micro-batches of 8 rows, one a device (program.check_splits)
        cfg = dataclasses.replace(CFG, batch_size=32, optim=dataclasses.replace(CFG.optim, grad_accum_steps=accum))
        fn, shardings, batch_sh, mesh, state, batches = make_step(cfg)
        jitted = program.jit_train_step(fn, shardings, batch_sh, mesh)
        metrics = []
        for batch in batches:
            state, m = jitted(state, batch)
            metrics.append(jax.device_get(m))
        results.append((metrics, jax.device_get(state.params)))
    (m1, p1), (m4, p4) = results
    for a, b in zip(m1, m4):
        np.testing.assert_allclose([a["loss"], a["grad_norm"]], [b["loss"], b["grad_norm"]], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p4)):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_the_eval_step_takes_the_batch_in_the_train_steps_micro_batches():
    """Accumulation is there to fit memory, and the eval step used to hold the whole
    batch's logits anyway: an eval that the train step's check passed could run out."""
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, vocab_size=4096), batch_size=32, seq_len=16)
    sums, temp = [], []
    for accum in (1, 4):
        c = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, grad_accum_steps=accum))
        mesh = make_mesh(c.mesh, jax.devices()[:8])
        prog = program.build(c, mesh)
        jitted = prog.jit_eval_step()
        batch = data.build(c).batch(0, prog.batch_shardings)
        sums.append(jax.device_get(jitted(prog.init_state().params, batch)))
        temp.append(jitted.lower(prog.state.params, prog.abstract_batch()).compile().memory_analysis()
                    .temp_size_in_bytes)
    assert sums[0]["tokens"] == sums[1]["tokens"] > 0
    np.testing.assert_allclose(sums[0]["loss_sum"], sums[1]["loss_sum"], rtol=1e-5)
    logits = cfg.batch_size * cfg.seq_len * cfg.model.vocab_size * 4 // 8  # fp32 bytes per device
    assert temp[1] < temp[0] - logits / 4, (temp, logits)  # 1/2 of it measured (CPU, 8 devices)


def test_bf16_compute_keeps_fp32_master_weights():
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, dtype="bfloat16"))
    fn, shardings, batch_sh, mesh, state, batches = make_step(cfg)
    jitted = program.jit_train_step(fn, shardings, batch_sh, mesh)
    losses = []
    for batch in batches:
        state, m = jitted(state, batch)
        losses.append(float(m["loss"]))
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    assert all(math.isfinite(l) for l in losses) and losses[-1] < losses[0]


def test_optimizer_schedule_and_decay_mask():
    opt = OptimConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lr = learning_rate_schedule(opt, 110)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)  # cosine midpoint
    assert float(lr(110)) == pytest.approx(0.1)
    _, _, _, _, _, state = build(dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, qkv_bias=True)),
                                 CFG.mesh, 8)
    mask = {"/".join(map(str, p)): v.get_value() if hasattr(v, "get_value") else v
            for p, v in jax.tree_util.tree_flatten_with_path(decay_mask(state.params))[0]
            for p in [[getattr(k, "key", k) for k in p]]}
    decayed = {k for k, v in mask.items() if v}
    assert any("up_DF" in k for k in decayed) and any("embed_VD" in k for k in decayed)
    assert not any("scale" in k or "bias" in k for k in decayed)
    assert any("bias" in k for k in mask) and any("scale" in k for k in mask)


def test_weight_decay_skips_norms_and_biases():
    """With zero gradients, AdamW's update is pure decay: norms and biases must not move."""
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, qkv_bias=True))
    _, _, _, _, _, state = build(cfg, CFG.mesh, 8)
    tx = make_optimizer(dataclasses.replace(cfg.optim, warmup_steps=0, weight_decay=0.5), 10)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    updates, _ = tx.update(zeros, tx.init(state.params), state.params)
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        name = jax.tree_util.keystr(path)
        if "scale" in name or "bias" in name:
            assert not np.any(np.asarray(u)), name
        else:
            assert np.any(np.asarray(u)), name


def run_main(tmp_path, *overrides):
    run_dir = tmp_path / "run"
    code = train.main(["--config", "tiny.py", f"--config.run_dir={run_dir}", *overrides])
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return code, run_dir, rows


def test_tiny_config_trains(tmp_path, monkeypatch):
    """The loss falls from ln(256) ~ 5.55 by at least 2 nats in 150 steps."""
    code, run_dir, rows = run_main(tmp_path, "--config.steps=150", "--config.eval_every=75",
                                   "--config.mesh.fsdp=4", "--config.mesh.data=2")
    assert code == 0
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(150))
    first, last = train_rows[0]["loss"], np.mean([r["loss"] for r in train_rows[-10:]])
    assert abs(first - math.log(256)) < 0.3
    assert last < first - 2.0, (first, last)
    # The synthetic language's exact floor: approached, and not beaten (a model that
    # sees less than a document's whole prefix cannot do better in expectation).
    floor = data.build(config_lib.load("tiny.py")).floor
    assert floor - 0.05 < last < floor + 0.35, (last, floor)
    assert all(abs(r["above_floor"] - (r["loss"] - floor)) < 1e-6 for r in train_rows)
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    for key in ("grad_norm", "learning_rate", "tokens_per_sec", "step_time", "mfu"):
        assert all(math.isfinite(r[key]) and r[key] >= 0 for r in train_rows), key
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 150
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    # Run again with fewer steps: refused, rather than saving step 150's state as "step 100";
    # and with other data: refused, as its saved iterator step points into other batches.
    # Both before the step compiles (they came after a compile and a read of the state).
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())

    def no_compile(*a, **k):
        raise AssertionError("compiled before refusing the run")
    monkeypatch.setattr(aot, "compile", no_compile)
    for change, message in (("--config.steps=100", "config.steps=100: .* already holds step 150"),
                            ("--config.data.seed=1", "the saved data iterator state is for data")):
        with pytest.raises(config_lib.ConfigError, match=message):
            train.main(["--config", "tiny.py", f"--config.run_dir={run_dir}", "--config.steps=200",
                        "--config.mesh.fsdp=4", "--config.mesh.data=2", change])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == saved


def test_a_run_started_at_a_data_step_reports_the_rate_each_update_took_also_after_a_resume(tmp_path):
    """With config.data.start_step=S the optimizer counts updates from 0 at step S, and a
    resume restored TrainState.step as the loop's step: learning_rate read S steps ahead."""
    import shutil
    args = ["--config", "tiny.py", "--config.steps=8", "--config.data.start_step=2", "--config.checkpoint.every=4",
            "--config.eval_every=0", "--config.tensorboard=false", "--config.model.embed_dim=32",
            "--config.model.mlp_dim=64", "--config.optim.warmup_steps=3"]
    assert train.main([*args, f"--config.run_dir={tmp_path / 'a'}"]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "8")  # as if killed after step 4's save
    assert train.main([*args, f"--config.run_dir={tmp_path / 'b'}"]) == 0
    rows = {name: {r["step"]: r for r in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())}
            for name in "ab"}
    schedule = learning_rate_schedule(config_lib.load("tiny.py", {"optim.warmup_steps": "3"}).optim, 8)
    for s in range(2, 8):
        assert rows["a"][s]["learning_rate"] == rows["b"][s]["learning_rate"] == pytest.approx(float(schedule(s - 2))), s
        assert rows["a"][s]["loss"] == rows["b"][s]["loss"], s


def test_a_nan_stops_training_with_the_step_range_and_no_checkpoint_holds_it(tmp_path):
    # At this rate step 1's loss is still finite but its gradient norm is NaN: the state
    # after it is NaN, and a save at step 2 (reading step 1's metrics) used to keep it.
    overrides = {"steps": "30", "optim.learning_rate": "1e5", "optim.warmup_steps": "0",
                 "optim.grad_clip_norm": "0", "checkpoint.every": "1", "checkpoint.async_save": "False"}
    with pytest.raises(TrainingDiverged, match=r"training diverged in steps \d+\.\.\d+"):
        run_main(tmp_path, *(f"--config.{k}={v}" for k, v in overrides.items()))
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(r["loss"]) for r in rows)  # what was written stays
    # A step's save reads that step's metrics first: a resume starts from a finite state.
    from hetjax import checkpoint
    from tests.test_checkpoint import abstract_for
    abstract, shardings = abstract_for(MeshConfig(), 1, config_lib.load("tiny.py", overrides))
    restored = checkpoint.Manager(tmp_path / "run" / "checkpoints", read_only=True).restore_latest(abstract, shardings)
    assert restored is not None
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(restored.state))), restored.step


def test_compile_only_reports_memory_and_flops(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train.main(["--config", "tiny.py", f"--config.run_dir={run_dir}", "--compile_only",
                       "--config.mesh.fsdp=2", "--config.mesh.tensor=4",
                       "--config.model.num_kv_heads=4"]) == 0
    out = capsys.readouterr().out
    assert "temp_bytes" in out and "argument_bytes" in out
    # Every layer's FLOPs (XLA's own count saw the scanned layer loop's body once): per
    # device, about the model's per-step count over the 8 devices.
    flops = float(out.split("flops: ")[1].split()[0])
    model = float(out.split("model_flops: ")[1].split()[0])
    assert 0.9 < flops * 8 / model < 1.6, (flops, model)
    assert not run_dir.exists()


def test_a_model_that_cannot_fit_is_refused_quickly():
    """Llama-3-8B on this CPU host: a clear answer within 60 s, before allocating."""
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hetjax.train", "--config", "llama8b.py",
                           "--config.device_memory_gib=24"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert time.monotonic() - t < 60
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    for word in ("GiB per device", "parameters 29.92", "optimizer 59.83", "activations",
                 "What would fit", "config.mesh.fsdp", "Nothing was allocated"):
        assert word in err, (word, err)


def test_a_stuck_tensorboard_writer_cannot_hold_the_exit(tmp_path, capsys):
    # A signal landing inside tensorboardX's queue once left its event thread unable to
    # take the stop sentinel: close() must give up after its timeout, not join for ever.
    import threading
    from hetjax import metrics
    writer = metrics.Writer(tmp_path, 1, tensorboard=True)
    writer.write(0, {"loss": 1.0})
    release = threading.Event()
    real_close = writer.tb.close
    writer.tb.close = lambda: (release.wait(), real_close())
    t = time.monotonic()
    writer.close(timeout_s=0.5)
    assert time.monotonic() - t < 5
    assert "did not close in 0.5s" in capsys.readouterr().err
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 1.0
    release.set()


def test_a_part_that_fails_to_close_leaves_the_others_closed_and_the_final_save_committed(tmp_path, monkeypatch):
    import signal
    from hetjax import checkpoint, profiler
    monkeypatch.setattr(profiler.Profiler, "close", lambda self: 1 / 0)  # closed first of all
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ZeroDivisionError):
        run_main(tmp_path, "--config.steps=3", "--config.eval_every=0", "--config.checkpoint.every=0")
    assert signal.getsignal(signal.SIGTERM) == before  # the handlers, closed last, are restored
    assert checkpoint.Manager(tmp_path / "run" / "checkpoints", read_only=True).steps() == [3]  # committed


def test_a_sigterm_in_the_last_step_finishes_the_run_with_its_final_eval(tmp_path, monkeypatch):
    """Stopping after the last step used to save and exit 143 before the final eval, and a
    rerun (already at config.steps) never ran it."""
    import os
    import signal
    from hetjax import job as job_lib
    steps = 3
    real_step = job_lib.MeshJob.train_step

    def step_then_sigterm(self, state, batch):
        last = int(jax.device_get(state.step)) == steps - 1  # before the step donates it
        out = real_step(self, state, batch)
        if last:
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler, during the last step
        return out

    monkeypatch.setattr(job_lib.MeshJob, "train_step", step_then_sigterm)
    code, run_dir, rows = run_main(tmp_path, f"--config.steps={steps}", "--config.eval_every=2",
                                   "--config.eval_batches=1", "--config.tensorboard=false")
    assert code == 0
    assert [r["step"] for r in rows if "loss" in r] == list(range(steps))
    assert [r["step"] for r in rows if "eval_loss" in r] == [1, steps - 1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())[-1] == str(steps)


def test_a_stop_saves_before_an_eval_due_at_its_step_and_a_failed_step_keeps_the_rows_before_it(tmp_path, monkeypatch):
    """A SIGTERM during the step before an eval boundary waited for the whole eval before it
    saved: a preemption's grace period could run out first, and its SIGKILL lose the
    checkpoint. And a step that raised lost the metrics row of the step before it, which
    had finished (it waited on the device for the next step's flush)."""
    from hetjax import checkpoint
    from hetjax import job as job_lib
    real_save, real_step, seen, calls = checkpoint.Manager.save, job_lib.MeshJob.train_step, {}, []

    def save(self, step, *args):
        log = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        seen[step] = sorted(json.loads(l)["step"] for l in log if "eval_loss" in json.loads(l))
        return real_save(self, step, *args)

    def train_step(self, state, batch):  # SIGTERM's handler, as during step index 2
        calls.append(1)
        if len(calls) == 3:
            self.request_stop()
        return real_step(self, state, batch)
    monkeypatch.setattr(checkpoint.Manager, "save", save)
    monkeypatch.setattr(job_lib.MeshJob, "train_step", train_step)
    args = ("--config.eval_every=3", "--config.eval_batches=1", "--config.checkpoint.every=0",
            "--config.tensorboard=false", "--config.model.num_layers=1")
    code, _, rows = run_main(tmp_path, "--config.steps=6", *args)
    assert code == 143
    assert seen == {3: []}  # saved before the eval due after step index 2
    assert [r["step"] for r in rows if "eval_loss" in r] == [2]  # which still ran, after the save

    def fails_at_3(self, state, batch):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: a step that ran out of memory")
        return real_step(self, state, batch)
    calls.clear()
    monkeypatch.setattr(job_lib.MeshJob, "train_step", fails_at_3)
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        run_main(tmp_path / "b", "--config.steps=6", *args)
    rows = [json.loads(l) for l in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [0, 1, 2]  # step index 2 finished: its row stays


def test_the_final_eval_is_logged_before_the_final_checkpoint_is_saved(tmp_path, monkeypatch):
    """A run killed once its last step's checkpoint was written resumes at config.steps and
    does nothing more: its final eval must already be in metrics.jsonl by then. (It was
    run after that save when config.checkpoint.every divided config.steps and eval_every
    did not, and so was lost to a SIGKILL between the two.)"""
    from hetjax import checkpoint
    real_save, seen = checkpoint.Manager.save, {}

    def save(self, step, *args):
        log = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        seen[step] = sorted(json.loads(l)["step"] for l in log if "eval_loss" in json.loads(l))
        return real_save(self, step, *args)

    monkeypatch.setattr(checkpoint.Manager, "save", save)
    code, _, rows = run_main(tmp_path, "--config.steps=6", "--config.eval_every=4", "--config.eval_batches=1",
                             "--config.checkpoint.every=3", "--config.tensorboard=false")
    assert code == 0
    assert seen == {3: [], 6: [3, 5]}  # the final eval (after step index 5) came before step 6's save
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 5]
