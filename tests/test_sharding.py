"""Sharding: the rule table decides placement, and the mesh never changes the math."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hetjax import data, program, sharding, step
from hetjax import config as config_lib
from hetjax import state as state_lib
from hetjax.config import Config, ConfigError, MeshConfig, ModelConfig, OptimConfig
from hetjax.mesh import make_mesh
from hetjax.optim import learning_rate_schedule, make_optimizer

CFG = Config(
    model=ModelConfig(vocab_size=128, num_layers=2, embed_dim=32, mlp_dim=64, num_heads=8,
                      num_kv_heads=4, head_dim=8, qkv_bias=True),
    optim=OptimConfig(learning_rate=1e-2, warmup_steps=1),
    batch_size=8, seq_len=16, steps=3)

MESHES = {
    "1 device": (MeshConfig(fsdp=1), 1),
    "fsdp=8": (MeshConfig(fsdp=8), 8),
    "fsdp=2,tensor=4": (MeshConfig(fsdp=2, tensor=4), 8),
    "data=2,fsdp=2,tensor=2": (MeshConfig(data=2, fsdp=2, tensor=2), 8),
    # Gradients summed over `data` once a step (config.sharding.grad_sync), accumulated too.
    "data=2,fsdp=2,tensor=2 once": (MeshConfig(data=2, fsdp=2, tensor=2), 8),
    "data=4 once, 2 accumulated": (MeshConfig(data=4, fsdp=1), 4),
}


def configured(name):
    """CFG with the grad_sync and accumulation a MESHES name asks for."""
    sync = "once" if " once" in name else "per_layer"
    return dataclasses.replace(CFG, sharding=dataclasses.replace(CFG.sharding, grad_sync=sync),
                               optim=dataclasses.replace(CFG.optim, grad_accum_steps=2 if "accumulated" in name else 1))


def build(cfg, mesh_cfg, num_devices):
    mesh = make_mesh(mesh_cfg, jax.devices()[:num_devices])
    prog = program.build(cfg, mesh)
    return mesh, prog.rules, prog.tx, prog.graphdef, prog.state_shardings, prog.init_state()


def run(cfg, mesh_cfg, num_devices):
    """First-step gradients and three steps of losses on this mesh."""
    mesh, rules, tx, graphdef, shardings, state = build(cfg, mesh_cfg, num_devices)
    batch_sh = program.batch_shardings(mesh, rules)
    stream = data.build(cfg)

    grad_fn = step.make_grad_fn(graphdef, mesh, rules, cfg.optim.grad_accum_steps, cfg.sharding.grad_sync)

    def mean_grads(params, batch):
        _, count, grads = grad_fn(params, batch)
        return jax.tree.map(lambda g: g / count, grads)

    grads = jax.jit(mean_grads, in_shardings=(shardings.params, batch_sh))(
        state.params, stream.batch(0, batch_sh))
    train_step = program.jit_train_step(
        step.make_train_step(graphdef, tx, learning_rate_schedule(cfg.optim, cfg.steps), mesh, rules,
                             cfg.optim.grad_accum_steps, cfg.sharding.grad_sync),
        shardings, batch_sh, mesh)
    losses = []
    for s in range(cfg.steps):
        state, metrics = train_step(state, stream.batch(s, batch_sh))
        losses.append(float(metrics["loss"]))
    return jax.device_get(grads), np.array(losses)


@pytest.fixture(scope="module")
def single_device():
    return run(CFG, *MESHES["1 device"])


@pytest.mark.parametrize("name", [n for n in MESHES if n != "1 device"])
def test_loss_and_gradients_agree_across_meshes(name, single_device):
    ref_grads, ref_losses = single_device
    grads, losses = run(configured(name), *MESHES[name])
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        scale = np.max(np.abs(r))
        np.testing.assert_allclose(g / scale, r / scale, atol=1e-5, err_msg=jax.tree_util.keystr(path))
    assert losses[-1] < losses[0]  # the three steps did train


def _all_reduces(hlo: str) -> tuple[int, int]:
    """(all-reduces in while-loop bodies, all-reduces in all) of a compiled module's text."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    inside = total = 0
    for computation in re.split(r"\n(?=\S)", hlo):  # each starts at column 0 (so do their "}")
        name = re.match(r"(?:ENTRY )?%?([\w.\-]*)", computation).group(1)
        n = len(re.findall(r" all-reduce(?:-start)?\(", computation))
        total += n
        inside += n if name in bodies else 0
    return inside, total


def test_grad_sync_once_sums_over_data_after_the_layer_loop_not_in_it():
    """XLA sums each layer's gradient over `data` inside the backward layer loop (a meeting
    of every process per layer); grad_sync='once' leaves one all-reduce, after the loop."""
    found = {}
    for sync in ("per_layer", "once"):
        cfg = dataclasses.replace(CFG, sharding=dataclasses.replace(CFG.sharding, grad_sync=sync))
        prog = program.build(cfg, make_mesh(MeshConfig(data=4, fsdp=1), jax.devices()[:4]))
        found[sync] = _all_reduces(prog.compile_train_step().as_text())
    assert found["per_layer"][0] >= 1, found  # else the test would see nothing
    assert found["once"][0] == 0 and found["once"][1] >= 1, found


@pytest.mark.parametrize("overrides, message", [
    ({"sharding.grad_sync": "each"}, r"config.sharding.grad_sync='each': use one of \('per_layer', 'once'\)"),
    ({"sharding.grad_sync": "once", "mesh.pipeline": "2"},
     r"grad_sync='once' with config.mesh.pipeline=2: a pipeline's stages .* set config.sharding.grad_sync='per_layer'"),
    ({"sharding.grad_sync": "once", "sharding.rules": repr(tuple(
        (n, ("data", "fsdp") if n == "embed" else t) for n, t in CFG.sharding.rules))},
     r"needs `data` to split the batch only .* maps \('embed', \('data', 'fsdp'\)\) onto `data`"),
    # The shards are the batch's rows over `data`: the batch must split over it, first.
    ({"sharding.grad_sync": "once", "sharding.rules": repr(tuple(
        (n, ("fsdp", "data") if n == "batch" else t) for n, t in CFG.sharding.rules))},
     r"grad_sync='once' .* maps 'batch' to \('fsdp', 'data'\); map it to `data` first"),
    ({"sharding.grad_sync": "once", "sharding.rules": repr(tuple(
        (n, "fsdp" if n == "batch" else t) for n, t in CFG.sharding.rules))}, r"maps 'batch' to 'fsdp'"),
    ({"sharding.grad_sync": "once", "model.attention_impl": "cudnn"},
     r"grad_sync='once' with config.model.attention_impl='cudnn': .* use attention_impl='xla' or "
     r"grad_sync='per_layer'"),
])
def test_grad_sync_refuses_what_it_cannot_do(overrides, message):
    cfg = CFG
    for key, text in overrides.items():
        cfg = config_lib.override(cfg, key, text)
    with pytest.raises(ConfigError, match=message):
        config_lib.validate(cfg)


def test_grad_sync_once_with_a_pipeline_counted_on_the_mesh():
    """config.mesh.pipeline=-1 is a pipeline or not by the devices: refused once counted."""
    once = config_lib.override(CFG, "sharding.grad_sync", "once")
    two = config_lib.override(config_lib.override(once, "mesh.pipeline", "-1"), "mesh.fsdp", "2")
    config_lib.validate(two)
    with pytest.raises(ConfigError, match=r"grad_sync='once' with config.mesh.pipeline=-1 \(2 stages\)"):
        program.build(two, make_mesh(two.mesh, jax.devices()[:4]))
    one = config_lib.override(config_lib.override(two, "mesh.fsdp", "1"), "mesh.data", "4")
    config_lib.validate(one)
    assert program.build(one, make_mesh(one.mesh, jax.devices()[:4])).plan is None  # 1 stage: no pipeline


def _spec(state, *path):
    leaf = state.params
    for key in path:
        leaf = leaf[key]
    return leaf.get_value().sharding.spec, leaf.get_value()


def test_parameter_shardings_follow_the_rules_table():
    mesh_cfg, n = MESHES["fsdp=2,tensor=4"]
    *_, state = build(CFG, mesh_cfg, n)
    spec, up = _spec(state, "blocks", "mlp", "up_DF")
    assert spec == P(None, "fsdp", "tensor")  # (layers, embed, mlp)
    L, D, F = up.shape
    assert {s.data.shape for s in up.addressable_shards} == {(L, D // 2, F // 4)}
    assert _spec(state, "blocks", "attn", "k_DKH")[0] == P(None, "fsdp", "tensor", None)
    assert _spec(state, "embed_VD")[0] == P("tensor", "fsdp")
    # Adam's moments live where their parameters do.
    mu = state.opt_state[1][0].mu["blocks"]["mlp"]["up_DF"].get_value()
    assert mu.sharding.spec == P(None, "fsdp", "tensor")

    # Another experiment is a rules edit, not a model edit.
    rules = dict(CFG.sharding.rules) | {"mlp": "fsdp", "embed": "tensor", "vocab": None}
    cfg = dataclasses.replace(CFG, sharding=dataclasses.replace(CFG.sharding, rules=tuple(rules.items())))
    *_, state = build(cfg, mesh_cfg, n)
    assert _spec(state, "blocks", "mlp", "up_DF")[0] == P(None, "tensor", "fsdp")
    assert _spec(state, "embed_VD")[0] == P(None, "tensor")


def test_batch_is_split_over_data_and_fsdp():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    spec = program.batch_shardings(mesh, CFG.sharding.rules)["inputs"].spec
    assert spec == P(("data", "fsdp"), None)


def test_a_mesh_axis_shards_only_one_dimension():
    rules = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("length", None))
    assert sharding.spec_for(("batch", "length", "embed"), rules) == P(("data", "fsdp"), None, None)
    assert sharding.spec_for(("embed", "batch"), rules) == P("fsdp", "data")


def test_constrain_is_a_noop_outside_logical_rules():
    x = jnp.ones((4, 4))
    assert sharding.constrain(x, ("batch", "embed")) is x


def test_refuses_a_layout_that_replicates_the_parameters():
    mesh = make_mesh(MeshConfig(fsdp=8))
    rules = tuple((name, None) for name, _ in CFG.sharding.rules)
    _, abstract = state_lib.abstract_state(CFG.model, 0, make_optimizer(CFG.optim, 3))
    layouts = sharding.param_layouts(abstract.params, mesh, rules)
    with pytest.raises(ConfigError, match="max_replicated_fraction"):
        sharding.check_replication(layouts, mesh, 0.1)
    # Pure data parallelism replicates on purpose and is allowed.
    dp = make_mesh(MeshConfig(data=8, fsdp=1))
    assert sharding.check_replication(sharding.param_layouts(abstract.params, dp, rules), dp, 0.1) == 0.0
    # ZeRO-3 over data (embed -> data) on data=4 x fsdp=2 splits every weight 4 ways: it
    # was refused as "100% of parameter bytes would be replicated on every device".
    zero3 = tuple((name, "data" if name == "embed" else target) for name, target in CFG.sharding.rules)
    mixed = make_mesh(MeshConfig(data=4, fsdp=2))
    layouts = sharding.param_layouts(abstract.params, mixed, zero3)
    assert sum(l.bytes_per_device for l in layouts) < sum(l.bytes for l in layouts) / 2
    assert sharding.check_replication(layouts, mixed, 0.1) < 0.1


def test_bytes_per_device_divide_by_the_shards():
    _, abstract = state_lib.abstract_state(CFG.model, 0, make_optimizer(CFG.optim, 3))
    one = sharding.param_layouts(abstract.params, make_mesh(MeshConfig(fsdp=1), jax.devices()[:1]),
                                 CFG.sharding.rules)
    eight = sharding.param_layouts(abstract.params, make_mesh(MeshConfig(fsdp=2, tensor=4)),
                                   CFG.sharding.rules)
    by_path = {l.path: l for l in eight}
    for l in one:
        assert l.bytes_per_device == l.bytes
        spec = by_path[l.path].spec
        parts = np.prod([{"fsdp": 2, "tensor": 4, None: 1}[a] for a in spec])
        assert by_path[l.path].bytes_per_device * parts == l.bytes
