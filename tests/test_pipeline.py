"""Pipeline parallelism: schedules, stage functions, and the pipelined step equal
to the unpipelined one on every mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax import config as config_lib
from hetjax import data, pipeline, program, sharding, step
from hetjax.compile import aot
from hetjax.config import (Config, ConfigError, MeshConfig, ModelConfig, OptimConfig, PipelineConfig,
                           validate)
from hetjax.mesh import make_mesh
from hetjax.optim import learning_rate_schedule
from hetjax.pipeline import stages
from hetjax.pipeline.schedule import check
from tests.test_sharding import build

CFG = Config(
    model=ModelConfig(vocab_size=64, num_layers=6, embed_dim=32, mlp_dim=64, num_heads=4,
                      num_kv_heads=2, head_dim=8),
    optim=OptimConfig(learning_rate=1e-2, warmup_steps=1),
    batch_size=8, seq_len=16, steps=3)


# ---------------------------------------------------------------------------
# The schedule as data


def _ticks(schedule):
    """{(op, micro-batch, stage): tick}, read independently of Schedule's helpers."""
    seen = {}
    for name, table in (("F", schedule.forward), ("B", schedule.backward)):
        for t, s in zip(*np.nonzero(table >= 0)):
            key = (name, int(table[t, s]), int(s))
            assert key not in seen, f"{key} runs twice"
            seen[key] = int(t)
    return seen


@pytest.mark.parametrize("kind", pipeline.KINDS)
def test_every_forward_and_backward_runs_once_in_dependency_order(kind):
    for S in range(1, 6):
        for M in range(S, 10):
            sched = pipeline.make_schedule(kind, S, M)
            tick = _ticks(sched)
            assert len(tick) == 2 * S * M  # each (micro-batch, stage) forward and backward once
            for m in range(M):
                for s in range(S):
                    if s > 0:  # the input was sent in an earlier tick
                        assert tick["F", m, s] > tick["F", m, s - 1]
                    if s < S - 1:  # the output gradient was sent in an earlier tick
                        assert tick["B", m, s] > tick["B", m, s + 1]
                    assert tick["B", m, s] >= tick["F", m, s]
            if kind == "1f1b":
                # Lockstep ticks last a backward (2) from tick S on, a forward before.
                bubble = 0.0 if S == 1 else 1 - 3 * M / (4 * M + 3 * S - 4)
                # Classic order: warm-up forwards, forward/backward pairs, cool-down;
                # one operation per tick, and stage s holds at most S-s inputs.
                for s in range(S):
                    w = min(S - 1 - s, M)
                    pairs = [op for i in range(M - w) for op in (("F", w + i), ("B", i))]
                    assert [op[:2] for op in sched.ops(s)] == [("F", m) for m in range(w)] + pairs + [
                        ("B", m) for m in range(M - w, M)]
                assert not np.any((sched.forward >= 0) & (sched.backward >= 0))
                assert all(sched.in_flight()[s] <= S - s for s in range(S))
                held = S - 1
            else:
                bubble = (S - 1) / (M + S - 1)
                held = M if kind == "gpipe" else min(M, 2 * S - 3)  # fused: bounded in S, above S
            assert sched.bubble_fraction() == pytest.approx(bubble)
            assert sched.in_flight().max() == (0 if S == 1 else held)  # the first stage re-embeds
            # The per-stage order that islands read matches the tables.
            for s in range(S):
                assert {v for _, _, v in sched.ops(s)} == {0}  # one chunk per stage
                ops = [op[:2] for op in sched.ops(s)]
                assert sorted(ops) == sorted([("F", m) for m in range(M)] + [("B", m) for m in range(M)])
                assert [tick[op, m, s] for op, m in ops] == sorted(tick[op, m, s] for op, m in ops)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b_fused"])
def test_interleaved_schedules_run_every_chunk_once_in_dependency_order(kind):
    for S in range(2, 5):
        for V in (2, 3):
            for M in range(S, 3 * S + 1):
                sched = pipeline.make_schedule(kind, S, M, V)
                J, tick = S * V, {}  # virtual stage j = v*S + s lives on stage s as chunk v
                for name, table, chunks in (("F", sched.forward, sched.forward_chunk),
                                            ("B", sched.backward, sched.backward_chunk)):
                    for t, s in zip(*np.nonzero(table >= 0)):
                        key = (name, int(table[t, s]), int(chunks[t, s]) * S + int(s))
                        assert key not in tick
                        tick[key] = int(t)
                assert len(tick) == 2 * M * J
                for m in range(M):
                    for j in range(J):
                        if j > 0:
                            assert tick["F", m, j] > tick["F", m, j - 1]
                        if j < J - 1:  # the gradient is consumed in the tick after it is sent
                            assert tick["B", m, j] == tick["B", m, j + 1] + 1
                        assert tick["B", m, j] >= tick["F", m, j]
                # Stash slots: no two inputs held at once share one.
                arrive, fs, bs, count = sched.slots()
                assert count == max(1, sched.in_flight().max())
                if M % S == 0:  # the warm-up shrinks with V: a smaller bubble than V = 1
                    assert sched.bubble_fraction() < pipeline.make_schedule(kind, S, M).bubble_fraction()
    sched = pipeline.make_schedule(kind, 2, 8, 2)
    assert sched.bubble_fraction() == pytest.approx(1 - 2 * 8 * 3 / (2 * 8 * 3 + 3))  # warm-up + cool-down: 3
    with pytest.raises(ConfigError, match="virtual_stages=2 with config.pipeline.schedule='1f1b'"):
        pipeline.make_schedule("1f1b", 2, 4, 2)


def test_evaluation_runs_each_microbatch_forward_once_per_stage_in_order():
    table, chunks = pipeline.forward_only(3, 4)
    assert not np.any(chunks > 0)
    assert table.shape == (6, 3)
    for s in range(3):
        runs = table[:, s][table[:, s] >= 0]
        assert runs.tolist() == list(range(4)) and table[s, s] == 0  # stage s starts at tick s


def test_the_check_refuses_a_schedule_out_of_order():
    sched = pipeline.make_schedule("gpipe", 2, 2)
    swapped = dataclasses.replace(sched, forward=sched.forward[:, ::-1].copy(),  # stage 1 first
                                  forward_chunk=sched.forward_chunk[:, ::-1].copy())
    with pytest.raises(ValueError, match="before the previous stage"):
        check(swapped)


def test_timeline_shows_every_operation(tmp_path):
    sched = pipeline.make_schedule("1f1b", 4, 8)
    text = pipeline.timeline(sched)
    rows = text.splitlines()[2:]
    assert len(rows) == 4 and "bubble 40.0%" in text  # 1 - 3*8/(4*8+3*4-4)
    for s, row in enumerate(rows):
        for m in range(8):
            assert f"F{m}" in row and f"B{m}" in row
    assert rows[0].split()[2] == "F0" and rows[3].split()[2:4] == [".", "."]
    pipeline.plot(sched, str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_the_command_draws_every_schedule_the_interleaved_ones_included(capsys):
    from hetjax.pipeline.__main__ import main
    assert main(["--stages", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    heads = [line.split(":")[0] for line in out.splitlines() if "micro-batches" in line]
    assert heads == [*pipeline.KINDS, "gpipe x2 virtual", "1f1b_fused x2 virtual"]
    assert "F0.1" in out and "B3.0" in out  # micro-batch 0 through chunk 1, 3's backward through chunk 0
    assert main(["--schedule", "1f1b", "--virtual-stages", "2"]) == 2
    err = capsys.readouterr().err
    assert "--virtual-stages 2 with --schedule 1f1b" in err and "set --virtual-stages 1" in err  # this command's options
    assert main(["--virtual-stages", "0"]) == 2  # was taken for the default, 2
    assert "--virtual-stages=0" in capsys.readouterr().err
    assert main(["--stages", "0"]) == 2  # named no option: "a schedule needs stages, ... got 0, 8, 1"
    assert "error: --stages 0: must be at least 1" in capsys.readouterr().err
    # Fewer micro-batches than stages: 1F1B's refusal drew nothing, gpipe's timelines included.
    assert main(["--stages", "3", "--microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if "micro-batches" in line] == ["gpipe", "gpipe x2 virtual"]
    assert "1F1B schedules left out: --microbatches 2 is below --stages 3" in out
    assert main(["--stages", "3", "--microbatches", "2", "--schedule", "1f1b"]) == 2
    err = capsys.readouterr().err
    assert "--microbatches 2 is smaller than the 3 pipeline stages" in err and "or --schedule gpipe" in err


def test_the_command_names_its_pictures_by_the_file_name_only(tmp_path, capsys, monkeypatch):
    """A dot in a directory name was taken for the extension's."""
    from hetjax.pipeline import __main__ as command
    drawn = []
    monkeypatch.setattr(command, "plot", lambda schedule, path: drawn.append(path))
    where = tmp_path / "runs.v2"
    assert command.main(["--stages", "2", "--microbatches", "2", "--png", str(where / "t")]) == 0
    assert drawn and all(p.startswith(str(where / "t_")) and p.endswith(".png") for p in drawn), drawn
    assert command.main(["--schedule", "gpipe", "--png", str(where / "one")]) == 0
    assert drawn[-1] == str(where / "one.png") and f"wrote {where / 'one.png'}" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# Stages as plain functions (what islands run), against the whole model


@pytest.mark.parametrize("unroll, kept", [(False, False), (True, False), (False, True)],
                         ids=["scanned", "unrolled", "residuals-kept"])
def test_stage_functions_chained_equal_the_model(unroll, kept):
    cfg = CFG.model
    mesh, rules, tx, graphdef, shardings, state = build(CFG, MeshConfig(fsdp=1), 1)
    params = jax.device_get(state.params)
    batch = data.build(CFG).train.rows(np.arange(4))  # four rows of step 0
    (loss, _), ref = jax.jit(jax.value_and_grad(step.loss_sums, has_aux=True), static_argnums=1)(
        params, graphdef, batch)

    forward = jax.jit(pipeline.stage_forward, static_argnums=0, static_argnames=("first", "last", "unroll"))
    backward = jax.jit(pipeline.stage_backward, static_argnums=0, static_argnames=("first", "last", "unroll"))
    layout = pipeline.make_layout(cfg.num_layers, 3, (1, 3, 2))
    parts = [pipeline.stage_params(params, layout, s) for s in range(3)]
    kw = [dict(first=s == 0, last=s == 2, unroll=unroll) for s in range(3)]
    # Islands' non-last stages keep their forward's residuals instead (config.pipeline.recompute).
    residuals = [stages.Residuals() for _ in range(2)]
    forward_keeping = [jax.jit(lambda p, x, b, s=s: stages.stage_forward_keeping(
        graphdef, p, x, b, residuals[s], first=s == 0, unroll=unroll)) for s in range(2)]
    backward_kept = [jax.jit(lambda p, x, k, dy, s=s: stages.stage_backward_kept(p, x, k, dy, residuals[s]))
                     for s in range(2)]
    xs, kept_by = [None], {}
    for s in range(3):
        if kept and s < 2:
            y, kept_by[s] = forward_keeping[s](parts[s], xs[-1], batch)
            # The stage's weight matrices go back in as the backward's arguments, not out as
            # residuals (a norm's scale may go out reshaped: a derived value, and small).
            leaves = jax.tree_util.tree_leaves_with_path((parts[s], xs[-1]))
            weights = {k for k, (path, v) in enumerate(leaves)
                       if "blocks" in jax.tree_util.keystr(path) and v.ndim >= 3}
            assert weights and weights <= set(residuals[s].positions)
            xs.append(y)
        else:
            xs.append(forward(graphdef, parts[s], xs[-1], batch, **kw[s]))
    np.testing.assert_allclose(xs[-1], loss, rtol=1e-6)
    dy, grads = None, []
    for s in reversed(range(3)):
        x = jnp.zeros_like(xs[1]) if s == 0 else xs[s]
        if kept and s < 2:
            g, dy = backward_kept[s](parts[s], xs[s], kept_by[s], dy)
        else:
            g, dy, _ = backward(graphdef, parts[s], x, batch, dy, **kw[s])
        grads.insert(0, dict((jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_leaves_with_path(g)))
    for path, r in jax.tree_util.tree_leaves_with_path(ref):
        key = jax.tree_util.keystr(path)
        # A stage's layers are its own; embedding and head gradients add over stages.
        g = np.concatenate([g[key] for g in grads]) if "blocks" in key else sum(g[key] for g in grads)
        np.testing.assert_allclose(g, r, rtol=2e-5, atol=2e-6 * np.abs(r).max(), err_msg=key)


def test_kept_residuals_hold_no_copy_of_the_weights_under_mixed_precision():
    # bf16 compute over fp32 weights: every layer casts its weights, and saved casts would
    # be a copy of the stage's weights per micro-batch in flight.
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, dtype="bfloat16"))
    mesh, rules, tx, graphdef, shardings, state = build(cfg, MeshConfig(fsdp=1), 1)
    layout = pipeline.make_layout(cfg.model.num_layers, 3, (1, 3, 2))
    part = pipeline.stage_params(jax.device_get(state.params), layout, 1)  # a middle stage: 3 layers
    batch = data.build(cfg).train.rows(np.arange(4))
    x = jax.random.normal(jax.random.key(0), (4, cfg.seq_len, cfg.model.embed_dim), jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(1), x.shape, jnp.bfloat16)
    residuals = stages.Residuals()
    y, kept = jax.jit(lambda p, x: stages.stage_forward_keeping(graphdef, p, x, batch, residuals, first=False))(part, x)
    weights = {w.shape for path, w in jax.tree_util.tree_leaves_with_path(part)
               if "blocks" in jax.tree_util.keystr(path) and w.ndim >= 3}
    assert weights and not weights & {r.shape for r in kept}
    # The gradients are jax.vjp's of the plain stage.
    g, dx = jax.jit(lambda p, x, k, dy: stages.stage_backward_kept(p, x, k, dy, residuals))(part, x, kept, dy)
    want_y, vjp = jax.vjp(lambda p, x: pipeline.stage_forward(graphdef, p, x, batch, first=False, last=False),
                          part, x)
    want_g, want_dx = vjp(dy)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(want_dx, np.float32), rtol=2e-2, atol=2e-2)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(want_g)):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max(),
                                   err_msg=jax.tree_util.keystr(path))


# ---------------------------------------------------------------------------
# The pipelined step against the unpipelined one


def _batches(cfg, mesh, rules):
    dataset, sh = data.build(cfg), program.batch_shardings(mesh, rules)
    return [dataset.batch(s, sh) for s in range(cfg.steps)]


def _mean_grads(grad_fn, params, batch):
    loss, count, grads = grad_fn(params, batch)
    return jax.tree.map(lambda g: g / count, grads)


@pytest.fixture(scope="module")
def reference():
    """First-step gradients and three steps of losses, unpipelined, on 1 device."""
    mesh, rules, tx, graphdef, shardings, state = build(CFG, MeshConfig(fsdp=1), 1)
    batches = _batches(CFG, mesh, rules)

    def grad_fn(params, batch):
        with sharding.logical_rules(mesh, rules):
            (l, c), g = jax.value_and_grad(step.loss_sums, has_aux=True)(params, graphdef, batch)
        return l, c, g

    grads = jax.device_get(jax.jit(_mean_grads, static_argnums=0)(grad_fn, state.params, batches[0]))
    train_step = program.jit_train_step(
        step.make_train_step(graphdef, tx, learning_rate_schedule(CFG.optim, CFG.steps), mesh, rules),
        shardings, program.batch_shardings(mesh, rules), mesh)
    losses = []
    for batch in batches:
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return grads, np.array(losses), jax.device_get(state.params)


def run_pipelined(cfg):
    mesh = make_mesh(cfg.mesh, jax.devices()[:np.prod([getattr(cfg.mesh, a) for a in
                                                       ("pipeline", "data", "fsdp", "tensor")])])
    prog = program.build(cfg, mesh)
    plan, rules, tx, graphdef, shardings = prog.plan, prog.rules, prog.tx, prog.graphdef, prog.state_shardings
    state = prog.init_state()
    batches = _batches(cfg, mesh, rules)
    grad_fn = pipeline.make_grad_fn(graphdef, mesh, rules, plan)
    grads = jax.jit(_mean_grads, static_argnums=0)(grad_fn, state.params, batches[0])
    train_step = program.jit_train_step(
        pipeline.make_train_step(graphdef, tx, learning_rate_schedule(cfg.optim, cfg.steps), mesh,
                                 rules, plan),
        shardings, program.batch_shardings(mesh, rules), mesh)
    losses = []
    for batch in batches:
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return plan, jax.device_get(grads), np.array(losses), jax.device_get(state)


def _assert_trees_close(got, ref):
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        scale = np.max(np.abs(r))
        np.testing.assert_allclose(g / scale, r / scale, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def _assert_params_close(got, ref, lr):
    """Weights after a few Adam steps. Adam divides each gradient by its own running
    magnitude, so an element whose gradient is ~0 turns float noise (1e-7 relative)
    into an update anywhere within +-lr: bound every element by a tenth of lr, and
    the mean difference tightly, which a wrong stage or layer would break."""
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        diff = np.abs(np.asarray(g) - np.asarray(r))
        assert diff.max() <= 0.1 * lr, (jax.tree_util.keystr(path), diff.max())
        assert diff.mean() <= 1e-6 * max(np.max(np.abs(r)), 1e-3), (jax.tree_util.keystr(path), diff.mean())


@pytest.mark.parametrize("mesh_cfg,pipe", [
    (MeshConfig(pipeline=2, fsdp=2, tensor=2), PipelineConfig("1f1b_fused", 4)),
    (MeshConfig(pipeline=4, data=2, fsdp=1), PipelineConfig("gpipe", 2, (2, 1, 2, 1))),
    (MeshConfig(pipeline=4, fsdp=1, tensor=2), PipelineConfig("1f1b", 4, (1, 2, 2, 1), scan_layers=True)),
], ids=["1f1b_fused-pp2-fsdp2-tp2", "gpipe-pp4-dp2-uneven", "1f1b-pp4-tp2-uneven-scanned"])
def test_pipelined_step_equals_the_unpipelined_one(mesh_cfg, pipe, reference):
    ref_grads, ref_losses, ref_params = reference
    cfg = dataclasses.replace(CFG, mesh=mesh_cfg, pipeline=pipe)
    validate(cfg)
    plan, grads, losses, state = run_pipelined(cfg)
    layout = plan.layout
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    _assert_trees_close(pipeline.from_stages(grads, layout), ref_grads)
    _assert_params_close(pipeline.from_stages(state.params, layout), ref_params, CFG.optim.learning_rate)
    assert losses[-1] < losses[0]
    if layout.padded:
        # Padding layers: zero gradient, and weights and Adam moments still exactly zero.
        pad = layout.source() < 0
        mu = state.opt_state[1][0].mu
        for tree in (grads, state.params, mu):
            for leaf in jax.tree.leaves(pipeline.stages.map_blocks(lambda x: x[pad], tree, other=lambda x: 0.0)):
                assert not np.any(leaf)
        # The stacked layers are split over the pipeline axis, the head is not.
        blocks = state.params["blocks"]["mlp"]["up_DF"].get_value()
        assert blocks.shape[0] == plan.stages * layout.per_stage


def test_unrolled_stage_layers_give_the_scanned_losses_without_a_layer_loop():
    # config.pipeline.scan_layers=False (the default) writes each stage's layers out:
    # the step then holds only the ticks' loop (the model's remat inside stays whole).
    runs = {}
    for scan in (True, False):
        cfg = dataclasses.replace(CFG, mesh=MeshConfig(pipeline=2, fsdp=1),
                                  model=dataclasses.replace(CFG.model, remat="full"),
                                  pipeline=PipelineConfig("1f1b_fused", 4, scan_layers=scan))
        validate(cfg)
        mesh = make_mesh(cfg.mesh, jax.devices()[:2])
        prog = program.build(cfg, mesh)
        train_step, state = prog.jit_train_step(), prog.init_state()
        batches = _batches(cfg, mesh, prog.rules)
        loops = train_step.lower(state, batches[0]).as_text().count("stablehlo.while")
        losses = []
        for batch in batches:
            state, metrics = train_step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[scan] = loops, losses
    assert runs[True][0] > runs[False][0] == 1, runs  # one loop: the ticks
    np.testing.assert_allclose(runs[False][1], runs[True][1], rtol=1e-6)


SMALL = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, num_layers=4), steps=20)


@pytest.fixture(scope="module")
def losses_unpipelined():
    mesh, rules, tx, graphdef, shardings, state = build(SMALL, MeshConfig(fsdp=1), 1)
    train_step = program.jit_train_step(
        step.make_train_step(graphdef, tx, learning_rate_schedule(SMALL.optim, SMALL.steps), mesh, rules),
        shardings, program.batch_shardings(mesh, rules), mesh)
    losses = []
    for batch in _batches(SMALL, mesh, rules):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)


@pytest.mark.parametrize("kind,virtual", [(k, 1) for k in pipeline.KINDS] + [("gpipe", 2), ("1f1b_fused", 2)])
def test_every_schedule_trains_like_the_unpipelined_model_for_20_steps(kind, virtual, losses_unpipelined):
    ref_losses, ref_params = losses_unpipelined
    cfg = dataclasses.replace(SMALL, mesh=MeshConfig(pipeline=2, fsdp=1),
                              pipeline=PipelineConfig(kind, 4, virtual_stages=virtual))
    validate(cfg)
    mesh = make_mesh(cfg.mesh, jax.devices()[:2])
    prog = program.build(cfg, mesh)
    train_step, state = prog.jit_train_step(), prog.init_state()
    losses = []
    for batch in _batches(cfg, mesh, prog.rules):
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert losses[-1] < losses[0] - 0.1
    params = pipeline.from_stages(jax.device_get(state.params), prog.plan.layout)
    _assert_params_close(params, ref_params, SMALL.optim.learning_rate)
    if virtual == 1:  # evaluation without interleaving is covered elsewhere
        return
    eval_loss = prog.jit_eval_step()(state.params, batch)
    got_eval = float(eval_loss["loss_sum"] / eval_loss["tokens"])
    ref_eval = step.make_eval_step(prog.graphdef, mesh, SMALL.sharding.rules)
    with sharding.logical_rules(mesh, SMALL.sharding.rules):
        ref = jax.jit(ref_eval)(pipeline.from_stages(state.params, prog.plan.layout), batch)
    np.testing.assert_allclose(got_eval, float(ref["loss_sum"] / ref["tokens"]), rtol=1e-5)


def test_interleaved_layout_is_a_permutation_of_the_model_layers():
    layout = pipeline.make_layout(8, 2, (), 2)  # chunks of 2: stage 0 holds layers 0-1 and 4-5
    assert layout.source().tolist() == [0, 1, 4, 5, 2, 3, 6, 7] and layout.reordered
    params = {"blocks": {"w": jnp.arange(8.0)[:, None] * jnp.ones((8, 3))}, "head": jnp.ones(2)}
    staged = pipeline.to_stages(params, layout)
    assert staged["blocks"]["w"][:, 0].tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    back = pipeline.from_stages(staged, layout)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))


# ---------------------------------------------------------------------------
# Memory: 1F1B holds O(S) stage inputs, GPipe O(M)


def test_1f1b_memory_does_not_grow_with_microbatches_like_gpipe():
    model = dataclasses.replace(CFG.model, num_layers=2, embed_dim=64, vocab_size=32)
    peak = {}
    for kind in ("gpipe", "1f1b"):
        for M in (4, 16):
            cfg = dataclasses.replace(CFG, model=model, mesh=MeshConfig(pipeline=2, fsdp=1),
                                      pipeline=PipelineConfig(kind, M), batch_size=2 * M, seq_len=32)
            prog = program.build(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))
            if kind == "1f1b":
                assert prog.plan.slots == 1  # the stash: at most S-1 stage inputs, whatever M
            params_sh, batch_sh = prog.state_shardings.params, prog.batch_shardings
            fn = jax.jit(pipeline.make_grad_fn(prog.graphdef, prog.mesh, prog.rules, prog.plan),
                         in_shardings=(params_sh, batch_sh))
            compiled = aot.compile(fn, aot.abstract(prog.state.params, params_sh),
                                   program.abstract_batch(cfg.batch_size, cfg.seq_len, batch_sh))
            peak[kind, M] = aot.analysis(compiled)["peak_bytes"]
    stage_input = 2 * 32 * 64 * 4  # one micro-batch's (b, T, D) fp32 activation
    gpipe_growth = peak["gpipe", 16] - peak["gpipe", 4]
    f1b_growth = peak["1f1b", 16] - peak["1f1b", 4]
    assert gpipe_growth >= 12 * stage_input  # 12 more stashed inputs
    assert f1b_growth < gpipe_growth / 4  # only the batch itself grows
    assert peak["1f1b", 16] < peak["gpipe", 16]


# ---------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("changes,match", [
    (dict(mesh=MeshConfig(pipeline=4)), r"num_layers=6 does not split evenly .*stage_layers"),
    (dict(mesh=MeshConfig(pipeline=2), pipeline=PipelineConfig(stage_layers=(2, 3))),
     r"stage_layers=\(2, 3\) adds up to 5"),
    (dict(mesh=MeshConfig(pipeline=2), pipeline=PipelineConfig(stage_layers=(2, 2, 2))),
     r"names 3 stages but config.mesh.pipeline=2"),
    (dict(mesh=MeshConfig(pipeline=3), pipeline=PipelineConfig("1f1b", 2)),
     r"microbatches=2 is smaller than the 3 pipeline stages"),
    (dict(mesh=MeshConfig(pipeline=4, fsdp=1), pipeline=PipelineConfig("1f1b_fused", 3, (1, 2, 2, 1))),
     r"microbatches=3 is smaller than the 4 pipeline stages"),
    (dict(mesh=MeshConfig(pipeline=2), pipeline=PipelineConfig("gpipe", 3)),
     r"batch_size=8 is not divisible by config.pipeline.microbatches=3"),
    (dict(mesh=MeshConfig(pipeline=2), pipeline=PipelineConfig("pipedream")), r"schedule='pipedream'"),
    (dict(mesh=MeshConfig(pipeline=2), optim=OptimConfig(grad_accum_steps=2)), r"grad_accum_steps=2"),
    (dict(mesh=MeshConfig(pipeline=2), pipeline=PipelineConfig("gpipe", virtual_stages=-1)),
     r"virtual_stages=-1: must be an integer >= 0 \(0: automatic"),
    (dict(mesh=MeshConfig(pipeline=2), pipeline=PipelineConfig("1f1b", virtual_stages=2)),
     r"virtual_stages=2 with config.pipeline.schedule='1f1b'"),
    (dict(mesh=MeshConfig(pipeline=2), pipeline=PipelineConfig("gpipe", virtual_stages=2)),
     r"num_layers=6 does not split into config.mesh.pipeline=2 stages x config.pipeline.virtual_stages=2"),
    (dict(mesh=MeshConfig(pipeline=2), pipeline=PipelineConfig("gpipe", stage_layers=(2, 4), virtual_stages=3)),
     r"stage_layers=\(2, 4\) with config.pipeline.virtual_stages=3"),
])
def test_bad_pipeline_configs_are_refused(changes, match):
    with pytest.raises(ConfigError, match=match):
        validate(dataclasses.replace(CFG, **changes))


def test_gradient_accumulation_is_refused_only_where_mesh_pipeline_minus_one_makes_stages():
    """Refused before the mesh was known, -1 that came to 1 stage (no pipeline at all) could
    not accumulate, and the error's advice (micro-batches) was ignored there."""
    cfg = dataclasses.replace(CFG, mesh=MeshConfig(pipeline=-1, fsdp=1), optim=OptimConfig(grad_accum_steps=2))
    validate(cfg)
    with pytest.raises(ConfigError, match=r"grad_accum_steps=2 with config.mesh.pipeline=-1 \(2 stages\)"):
        validate(dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, stage_layers=(1, 1))))  # "-1 stages"
    with pytest.raises(ConfigError, match=r"grad_accum_steps=2 with config.mesh.pipeline=-1 \(2 stages\)"):
        pipeline.make_plan(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))  # the pipelined step ignored it
    one = dataclasses.replace(cfg, mesh=MeshConfig(pipeline=-1, fsdp=2))
    validate(one)
    assert pipeline.make_plan(one, make_mesh(one.mesh, jax.devices()[:2])) is None  # the plain step accumulates


def test_refuses_a_microbatch_that_data_parallelism_cannot_split():
    cfg = dataclasses.replace(CFG, mesh=MeshConfig(pipeline=2, data=4), pipeline=PipelineConfig("1f1b", 4))
    validate(cfg)
    with pytest.raises(ConfigError, match=r"micro-batch of .* 2 rows does not split over data x fsdp = 4"):
        pipeline.make_plan(cfg, make_mesh(cfg.mesh))
    # The axes are the `batch` rule's: kept whole over data, the 2 rows need no split.
    rules = tuple((k, "fsdp" if k == "batch" else v) for k, v in CFG.sharding.rules)
    assert pipeline.make_plan(dataclasses.replace(cfg, sharding=dataclasses.replace(cfg.sharding, rules=rules)),
                              make_mesh(cfg.mesh)) is not None
    rules = dict(CFG.sharding.rules) | {"embed": "pipeline"}
    with pytest.raises(ConfigError, match="maps 'embed' to the 'pipeline' mesh axis"):
        pipeline.sharding_rules(tuple(rules.items()))
    rules = dict(CFG.sharding.rules) | {"layers": "fsdp"}  # was replaced by pipeline without a word
    with pytest.raises(ConfigError, match=r"maps 'layers' to 'fsdp', but .* the pipeline stages take the layers; "
                                          r"use \('layers', None\)"):
        pipeline.sharding_rules(tuple(rules.items()))
    assert dict(pipeline.sharding_rules(tuple((dict(CFG.sharding.rules) | {"layers": "pipeline"}).items())))[
        "layers"] == "pipeline"


def test_an_interleaved_pipeline_checkpoints_in_the_model_layer_order(tmp_path):
    # Interleaved stacked layers have the model's shapes in another order: saved as they
    # are, they would restore into any other layout without an error, scrambled.
    from hetjax import checkpoint, checkpoint_init, job
    from hetjax.checkpoint_config import CheckpointConfig
    cfg = dataclasses.replace(SMALL, mesh=MeshConfig(pipeline=2, fsdp=1),
                              pipeline=PipelineConfig("gpipe", 4, virtual_stages=2))
    mesh = make_mesh(cfg.mesh, jax.devices()[:2])
    prog = program.build(cfg, mesh)
    state, _ = prog.jit_train_step()(prog.init_state(), next(iter(_batches(cfg, mesh, prog.rules))))
    state = jax.device_get(jax.block_until_ready(state))  # the step donates; keep a host copy
    saved = jax.device_put(state, prog.state_shardings)
    ckpt = job.ModelOrderCheckpoints(checkpoint.Manager(tmp_path / "c", CheckpointConfig(every=1)),
                                     prog.plan.layout, prog.state_shardings)
    ckpt.save(1, saved, {"step": 1}, {})
    ckpt.wait()
    flat = dataclasses.replace(cfg, mesh=MeshConfig(fsdp=2), pipeline=PipelineConfig())
    other = program.build(flat, make_mesh(flat.mesh, jax.devices()[:2]))
    params = checkpoint_init.load_params(tmp_path / "c", other.state.params, other.state_shardings.params)
    expected = pipeline.from_stages(state.params, prog.plan.layout)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)))
    restored = ckpt.restore_latest(prog.state, prog.state_shardings)
    assert restored.step == 1
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)))
    ckpt.close()


@pytest.mark.parametrize("layers,split", [(4, "(1,3)"), (3, "(1,2)")])  # read split over stages, or not
def test_an_uneven_split_starts_from_a_checkpoint_in_the_model_s_order(tmp_path, layers, split):
    """An unpipelined run's checkpoint (or an import's) used to be refused by every uneven
    split, with advice to give a checkpoint in the model's order: now its layers go into the
    split's padded rows, and the run goes on from the same weights with the same loss."""
    from hetjax import train
    from hetjax.repro import read
    args = ["--config", "tiny.py", f"--config.model.num_layers={layers}", "--config.pipeline.schedule=1f1b_fused",
            "--config.pipeline.microbatches=2", "--config.eval_every=0", "--config.tensorboard=false",
            "--config.steps=2", "--config.fingerprint_every=1"]
    assert train.main([*args, "--config.mesh.fsdp=8", "--config.checkpoint.every=1",
                       f"--config.run_dir={tmp_path / 'a'}"]) == 0
    assert train.main([*args, "--config.mesh.pipeline=2", "--config.mesh.fsdp=4",
                       f"--config.pipeline.stage_layers={split}", "--config.data.start_step=1",
                       f"--config.run_dir={tmp_path / 'b'}", f"--config.init_from={tmp_path / 'a' / 'checkpoints' / '1'}"]) == 0
    (_, steps_a, params_a), (_, steps_b, params_b) = read(tmp_path / "a"), read(tmp_path / "b")
    assert params_b[1]["params"] == params_a[1]["params"]  # the same weights, bit for bit
    np.testing.assert_allclose(steps_b[1]["loss"], steps_a[1]["loss"], rtol=1e-5)  # on the same batch


def test_an_uneven_split_s_checkpoint_is_refused_by_another_uneven_split(tmp_path, monkeypatch):
    """(1, 3) and (3, 1) pad to the same shapes: the second used to resume, or start from
    (init_from), the first's checkpoint without an error, model layers in padding rows and
    padding as layers; and its export wrote padding rows as layers 1 and 2."""
    from hetjax import checkpoint, checkpoint_fit, convert, safetensors_io, train
    run_dir = tmp_path / "run"
    args = ["--config", "tiny.py", "--config.model.num_layers=4", "--config.mesh.fsdp=4",
            "--config.pipeline.schedule=1f1b_fused", "--config.pipeline.microbatches=2", "--config.eval_every=0",
            "--config.tensorboard=false"]
    uneven = [*args, f"--config.run_dir={run_dir}", "--config.mesh.pipeline=2"]
    assert train.main([*uneven, "--config.steps=1", "--config.pipeline.stage_layers=(1,3)"]) == 0

    reads = []  # the refusal comes before any of the checkpoint's arrays is read
    with pytest.raises(ConfigError, match=r"stage_layers=\(1, 3\).*stage_layers=\(3, 1\)"), monkeypatch.context() as m:
        m.setattr(checkpoint, "saved_dtypes", lambda *a: reads.append(a) or checkpoint_fit.saved_dtypes(*a))
        train.main([*uneven, "--config.steps=2", "--config.pipeline.stage_layers=(3,1)"])
    assert not reads, "the checkpoint's arrays were read before its split was checked"
    assert train.main([*uneven, "--config.steps=2", "--config.pipeline.stage_layers=(1,3)"]) == 0  # the same resumes
    # Resumed unpipelined, it was refused by the shape check, which advised changing config.model.
    with pytest.raises(ConfigError, match=r"holds its layers as the uneven pipeline split stage_layers=\(1, 3\) .*"
                                          r"needs them in the model's order; resume with that split"):
        train.main([*args, f"--config.run_dir={run_dir}", "--config.steps=3", "--config.mesh.fsdp=-1"])
    for other in (["--config.mesh.pipeline=2", "--config.pipeline.stage_layers=(3,1)"], ["--config.mesh.pipeline=1", "--config.mesh.fsdp=8"]):
        with pytest.raises(ConfigError, match=r"config.init_from: .* holds its layers as the uneven pipeline "
                                              r"split stage_layers=\(1, 3\) lays them out"):
            train.main([*args, *other, f"--config.run_dir={tmp_path / 'new'}", f"--config.init_from={run_dir}",
                        "--config.steps=1"])
    # Exported, the four layers are the model's: none is a padding row (all zeros)
    convert.export_hf(run_dir, tmp_path / "hf")
    hf = safetensors_io.open_dir(tmp_path / "hf")
    norms = [hf[f"model.layers.{i}.input_layernorm.weight"].get(f"model.layers.{i}.input_layernorm.weight")
             for i in range(4)]
    assert all(np.abs(n).sum() > 0 for n in norms) and "model.layers.4.input_layernorm.weight" not in hf


def test_the_plan_describes_interleaved_chunks_as_chunks():
    """V=2 over 2 stages printed '2 stages of (1, 1, 1, 1) layers': chunk sizes as stages'."""
    cfg = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, num_layers=4),
                              mesh=MeshConfig(pipeline=2, fsdp=1), pipeline=PipelineConfig("gpipe", 4, virtual_stages=2))
    text = pipeline.make_plan(cfg, make_mesh(cfg.mesh, jax.devices()[:2])).describe()
    assert "2 stages x 2 interleaved chunks of 1 layers, 4 micro-batches" in text, text
    even = dataclasses.replace(cfg, pipeline=PipelineConfig("gpipe", 4, virtual_stages=1))
    assert "2 stages of (2, 2) layers" in pipeline.make_plan(even, make_mesh(even.mesh, jax.devices()[:2])).describe()


@pytest.mark.parametrize("changes,expected", [
    ({}, 2),  # 4 layers over 2 stages, 4 micro-batches: 2 chunks of one layer per stage
    ({"pipeline.schedule": "gpipe"}, 2),
    ({"pipeline.virtual_stages": "1"}, 1),  # given: kept
    ({"pipeline.virtual_stages": "4", "model.num_layers": "8"}, 4),
    ({"pipeline.schedule": "1f1b"}, 1),  # does not interleave
    ({"model.num_layers": "6"}, 1),  # 6 layers: not 2 x 2 equal chunks
    ({"pipeline.stage_layers": "(1, 3)"}, 1),  # an uneven split
    ({"pipeline.microbatches": "3", "batch_size": "9"}, 1),  # the last M mod S would go round alone
    ({"mesh.pipeline": "1"}, 1),
    ({"mesh.pipeline": "-1"}, 1),  # until the mesh counts the stages
], ids=lambda v: str(v))
def test_automatic_virtual_stages_interleave_where_two_chunks_run_and_gain(changes, expected):
    cfg = dataclasses.replace(SMALL, mesh=MeshConfig(pipeline=2, fsdp=1))
    for key, text in changes.items():
        cfg = config_lib.override(cfg, key, text)
    assert PipelineConfig().virtual_stages == 0  # the default is the automatic choice
    assert pipeline.config.virtual_stages(cfg, cfg.mesh.pipeline) == expected


def test_the_default_pipeline_runs_interleaved_chunks_and_islands_run_none():
    """The plan, not only the rule: the default config on 2 stages (given, or counted from
    config.mesh.pipeline=-1) holds 2 interleaved chunks per stage."""
    for mesh_cfg in (MeshConfig(pipeline=2, fsdp=1), MeshConfig(pipeline=-1, fsdp=1)):
        cfg = dataclasses.replace(SMALL, mesh=mesh_cfg)
        validate(cfg)
        plan = pipeline.make_plan(cfg, make_mesh(cfg.mesh, jax.devices()[:2]))
        assert plan.layout.virtual == 2 and plan.layout.source().tolist() == [0, 2, 1, 3], plan.describe()
    from hetjax.hetero.config import HeteroConfig, IslandConfig
    islands = HeteroConfig(islands=(IslandConfig(name="a"), IslandConfig(name="b")), placement="pipeline")
    assert pipeline.config.virtual_stages(dataclasses.replace(SMALL, hetero=islands), 2) == 1


def test_the_automatic_chunks_train_like_the_unpipelined_model_on_data_and_tensor_axes(losses_unpipelined):
    """The default pipeline interleaves (2 chunks per stage) here on pipeline x data x tensor,
    meshes the 20-step schedule test leaves uninterleaved: its first 3 losses are the
    unpipelined model's."""
    ref_losses, _ = losses_unpipelined
    cfg = dataclasses.replace(SMALL, mesh=MeshConfig(pipeline=2, data=2, fsdp=1, tensor=2))
    validate(cfg)
    mesh = make_mesh(cfg.mesh, jax.devices()[:8])
    prog = program.build(cfg, mesh)
    assert prog.plan.layout.virtual == 2, prog.plan.describe()
    train_step, state = prog.jit_train_step(), prog.init_state()
    losses = []
    for batch in _batches(cfg, mesh, prog.rules)[:3]:
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses[:3], rtol=1e-5)


def test_the_default_pipeline_interleaves_says_so_and_resumes_unpipelined(tmp_path, capsys):
    """End to end: a 4-layer model on 2 stages runs 2 chunks per stage by default, the start-up
    log says it was chosen, and its checkpoint (in the model's layer order) resumes on an
    unpipelined mesh to the losses of a run that was never pipelined."""
    from hetjax import train
    from hetjax.repro import read
    args = ["--config", "tiny.py", "--config.model.num_layers=4", "--config.eval_every=0",
            "--config.tensorboard=false", "--config.checkpoint.async_save=false"]
    run, flat = tmp_path / "run", tmp_path / "flat"
    assert train.main([*args, "--config.mesh.pipeline=2", "--config.mesh.fsdp=4", "--config.steps=2",
                       "--config.checkpoint.every=1", f"--config.run_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "2 stages x 2 interleaved chunks of 1 layers" in out and "virtual_stages=0 chose 2" in out, out
    assert train.main([*args, "--config.mesh.fsdp=8", "--config.steps=3", f"--config.run_dir={run}"]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert train.main([*args, "--config.mesh.fsdp=8", "--config.steps=3", f"--config.run_dir={flat}"]) == 0
    (_, resumed, _), (_, straight, _) = read(run), read(flat)
    assert sorted(resumed) == sorted(straight) == [0, 1, 2]
    np.testing.assert_allclose([resumed[s]["loss"] for s in range(3)], [straight[s]["loss"] for s in range(3)],
                               rtol=1e-5)
