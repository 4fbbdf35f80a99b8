"""The split backward (config.pipeline.split_backward): its input-gradient and weight-gradient
parts against jax.vjp of the whole stage, each product computed once, and the islands'
order of the parts against ZB-H1's bubble."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hetjax import state as state_lib
from hetjax.config import ModelConfig
from hetjax.pipeline.schedule import make_schedule, split_orders
from hetjax.pipeline.split import Split
from hetjax.pipeline.stages import Residuals, stage_forward

ROWS, T = 2, 32


def _stage(first, last, **model):
    cfg = dataclasses.replace(ModelConfig(), num_layers=2, **model)
    graphdef, params = nnx.split(state_lib.make_model(cfg, 0))
    keys = jax.random.split(jax.random.key(1), 4)
    batch = {"inputs": jax.random.randint(keys[0], (ROWS, T), 0, cfg.vocab_size),
             "targets": jax.random.randint(keys[1], (ROWS, T), 0, cfg.vocab_size),
             "positions": jnp.broadcast_to(jnp.arange(T), (ROWS, T)),
             # two packed documents per row: the attention mask is activation-side data
             "segment_ids": jnp.repeat(jnp.array([[1, 2]]), T // 2, axis=1).repeat(ROWS, 0),
             "loss_mask": jnp.ones((ROWS, T), bool).at[:, :3].set(False)}
    x = None if first else jax.random.normal(keys[2], (ROWS, T, cfg.embed_dim), cfg.dtype)
    dy = jax.random.normal(keys[3], (ROWS, T, cfg.embed_dim), cfg.dtype)

    def fn(p, x, b, unroll=False):
        return stage_forward(graphdef, p, x, b, first=first, last=last, unroll=unroll)
    return fn, params, x, batch, dy


def _parts(split, last):
    def run(params, x, batch, dy):
        y, vjp, acts = split.forward(params, x, batch)
        dx, dys = Split.input_grads(vjp, jnp.ones_like(y) if last else dy)
        return y, dx, split.weight_grads(params, acts, dys)
    return jax.jit(run)


@pytest.mark.parametrize("first,last", [(False, False), (True, False), (False, True)], ids=["middle", "first", "last"])
@pytest.mark.parametrize("model", [{}, {"remat": "full", "tie_embeddings": True, "qkv_bias": True}],
                         ids=["plain", "remat-tied-bias"])
def test_the_two_parts_give_the_gradients_of_jax_vjp(first, last, model):
    fn, params, x, batch, dy = _stage(first, last, **model)
    y_ref, vjp = jax.vjp(lambda p, x: fn(p, x, batch), params, x)
    grads_ref, dx_ref = vjp(jnp.ones_like(y_ref) if last else dy)
    y, dx, grads = _parts(Split(fn, params, x, batch), last)(params, x, batch, dy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    if not first:
        np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-6)
    for (path, g), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
    # Every parameter the stage uses gets a gradient (none silently left at zero).
    used = [jnp.any(w != 0) for w in jax.tree.leaves(grads_ref)]
    assert [bool(jnp.any(g != 0)) for g in jax.tree.leaves(grads)] == [bool(u) for u in used]


def test_weights_cast_to_bf16_get_their_gradients_through_the_cast():
    fn, params, x, batch, dy = _stage(False, False, dtype="bfloat16")
    x, dy = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
    grads_ref = jax.jit(lambda p, x, dy: jax.vjp(lambda p, x: fn(p, x, batch), p, x)[1](dy)[0])(params, x, dy)
    _, _, grads = _parts(Split(fn, params, x, batch), False)(params, x, batch, dy)
    for g, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        assert g.dtype == want.dtype == jnp.float32
        np.testing.assert_allclose(g, want, rtol=0, atol=2e-2 * float(jnp.max(jnp.abs(want))))  # bf16 rounding


def _dots(fn, *args) -> int:
    return len(re.findall(r"\bdot\(", jax.jit(fn).lower(*args).compile().as_text()))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_each_product_runs_once_over_the_two_parts(remat):
    # The split pays for no recomputation: forward + B + W hold as many matrix products as
    # the forward and one fused backward, and B holds none of the weight gradients'. (A
    # remat-wrapped layer is cut through too, not left whole for W to run again.)
    fn, params, x, batch, dy = _stage(False, False, remat=remat)
    unrolled = lambda p, x, b: fn(p, x, b, unroll=True)  # noqa: E731 - the split writes the layers out
    split = Split(unrolled, params, x, batch)
    forward = _dots(lambda p, x: unrolled(p, x, batch), params, x)
    plain = lambda p, x, b: _stage(False, False)[0](p, x, b, unroll=True)  # noqa: E731 - the layers without remat
    fused = _dots(lambda p, x, dy: jax.vjp(lambda p, x: plain(p, x, batch), p, x)[1](dy), params, x, dy)
    _, vjp, acts = jax.jit(split.forward)(params, x, batch)
    dx, dys = Split.input_grads(vjp, dy)
    b = _dots(lambda p, x, dy: Split.input_grads(split.forward(p, x, batch)[1], dy), params, x, dy) - forward
    w = _dots(split.weight_grads, params, acts, dys)
    weights = 7 * 2  # q, k, v, o, gate, up, down in each of 2 layers
    assert w == weights and b + w == fused - forward, (forward, fused, b, w)


def _makespan(schedule, orders, split):
    """An independent replay of the islands' orders with unit costs and instant links (a
    backward 2 unsplit; the last stage's backward also runs its forward)."""
    S, J = schedule.stages, schedule.stages * schedule.virtual
    done, free, at = {}, [0.0] * S, [0] * S
    while any(at[s] < len(orders[s]) for s in range(S)):
        moved = False
        for s in range(S):
            while at[s] < len(orders[s]):
                op, m, v = orders[s][at[s]]
                j = v * S + s
                need = {"F": ("F", m, j - 1) if j else None, "W": None,
                        "B": ("F", m, j) if j == J - 1 else ("B", m, j + 1)}[op]
                if need is not None and need not in done:
                    break
                cost = {"F": 0.0 if j == J - 1 else 1.0, "W": 1.0, "B": 1.0 if split else 2.0}[op]
                cost += 1.0 if (op, j) == ("B", J - 1) else 0.0
                free[s] = done[op, m, j] = max(free[s], done[need] if need else 0.0) + cost
                at[s] += 1
                moved = True
        assert moved, "the orders deadlock"
    return max(free)


@pytest.mark.parametrize("kind,S,M,V", [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b_fused", 4, 8, 1),
                                         ("gpipe", 2, 4, 1), ("1f1b_fused", 2, 4, 2)])
def test_split_orders_fill_the_waits_with_weight_gradients(kind, S, M, V):
    schedule = make_schedule(kind, S, M, V)
    orders = split_orders(schedule)
    for s in range(S):
        ops = orders[s]
        assert sorted(ops) == sorted([(op, m, v) for m in range(M) for v in range(V) for op in "FBW"])
        # forwards and backwards keep the schedule's order; W's run in their backwards' order
        assert [o for o in ops if o[0] != "W"] == schedule.ops(s)
        assert [o[1:] for o in ops if o[0] == "W"] == [o[1:] for o in ops if o[0] == "B"]
        assert all(ops.index(("W", m, v)) > ops.index(("B", m, v)) for _, m, v in ops)
        # at most S backwards' output gradients wait for their W, S + 1 between a B and the W it forces
        waiting = np.cumsum([{"B": 1, "W": -1}.get(op, 0) for op, _, _ in ops])
        assert waiting.max() <= S + 1 and all(w <= S for w, (op, _, _) in zip(waiting, ops) if op != "B")
    whole = _makespan(schedule, [schedule.ops(s) for s in range(S)], split=False)
    split = _makespan(schedule, orders, split=True)
    if kind == "1f1b" and V == 1:
        # ZB-H1 (Qi et al., 2023) with F = B = W: 1F1B idles (S-1)(F+B+W), ZB-H1 (S-1)(F+B-W)
        assert (whole, split) == (3 * M + 3 * (S - 1), 3 * M + (S - 1))
    assert split < whole


def test_an_island_s_memory_estimate_bounds_what_its_split_backward_holds():
    # A split stage holds each micro-batch's B residuals and W inputs from its forward, and its
    # output gradients from B to W, remat or not: under remat=full far more than the layers'
    # inputs. None of it is a copy of the weights.
    from hetjax import memory, program
    from hetjax.config import load
    from hetjax.hetero.island import island_config
    from hetjax.mesh import make_mesh
    from tests.test_hetero import tiny_islands
    # A model whose layers, not its vocabulary, hold most of the activations (shapes only).
    big = {"model.remat": "full", "model.num_layers": "64", "model.embed_dim": "512", "model.mlp_dim": "1536",
           "seq_len": "32", "model.head_dim": "128"}
    cfg = tiny_islands({**big, "pipeline.split_backward": "True"})
    part = island_config(cfg, 0)
    mesh = make_mesh(part.mesh, jax.devices()[:2])
    layouts = program.build(load("tiny.py", {**big, "mesh.fsdp": "2"}), mesh).layouts
    M, rows = cfg.pipeline.microbatches, cfg.batch_size // cfg.pipeline.microbatches
    model = dataclasses.replace(cfg.model, num_layers=cfg.model.num_layers // 2)  # the island's layers
    graphdef, params = nnx.split(nnx.eval_shape(lambda: state_lib.make_model(model, 0)))
    x = jax.ShapeDtypeStruct((rows, cfg.seq_len, model.embed_dim), model.dtype)
    micro = {k: jax.ShapeDtypeStruct((rows, cfg.seq_len), jnp.int32) for k in ("positions", "segment_ids")}
    split = Split(lambda p, x, b: stage_forward(graphdef, p, x, b, first=False, last=False), params, x, micro)
    residuals = Residuals()

    def forward(p, x):  # what the island's split forward returns: B's residuals and W's inputs
        _, vjp, acts = split.forward(p, x, micro)
        return residuals.split(vjp, (p, x)), acts
    kept = jax.eval_shape(forward, params, x)
    layer_weights = {w.shape[1:] for w in jax.tree.leaves(params["blocks"])}
    assert not any(a.shape in layer_weights for a in jax.tree.leaves(kept[0]))  # no copy of a layer's weights
    avals = jax.tree.leaves(kept) + [a for avals in split.tap_avals for a in avals]  # and the output gradients
    held = M * sum(a.size * a.dtype.itemsize for a in avals) / mesh.shape["fsdp"]  # rows split over fsdp
    assert memory.estimate(part, layouts, mesh).activations >= held
    unsplit = dataclasses.replace(part, pipeline=dataclasses.replace(part.pipeline, split_backward=False))
    assert memory.estimate(unsplit, layouts, mesh).activations < held  # what remat=full alone would count


def test_the_timeline_command_prints_each_island_s_split_order(capsys):
    from hetjax.pipeline.__main__ import main
    assert main(["--stages", "2", "--microbatches", "4", "--schedule", "1f1b", "--split-backward"]) == 0
    out = capsys.readouterr().out
    assert "whole backwards (each runs its own order, no lockstep): 15 forwards a step" in out
    assert "split into B (input gradient) and W (weight gradient)" in out and "13 forwards a step" in out
    assert "island 1 F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3" in out


def test_the_timeline_command_draws_the_islands_split_order(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from hetjax.pipeline.__main__ import main
    assert main(["--stages", "2", "--microbatches", "4", "--schedule", "1f1b", "--split-backward",
                 "--png", str(tmp_path / "t.png")]) == 0
    assert f"wrote {tmp_path / 't_islands_split.png'}" in capsys.readouterr().out
    assert (tmp_path / "t.png").stat().st_size > 1000 and (tmp_path / "t_islands_split.png").stat().st_size > 1000
