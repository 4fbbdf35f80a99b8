"""The planner: per-device bytes against an analytic count, FLOPs against 6N + attention,
collective traffic, and its command line."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from hetjax import metrics, program
from hetjax.compile import hardware, hlo, plan
from hetjax.compile.cli import run
from hetjax.config import Config, ConfigError, MeshConfig, ModelConfig, load
from hetjax.mesh import make_mesh
from hetjax.plan import main as plan_main
from hetjax.repro.check import cpu_env

ROOT = Path(__file__).resolve().parent.parent
TINY = Config(model=ModelConfig(vocab_size=64, num_layers=3, embed_dim=32, mlp_dim=64, num_heads=4,
                                num_kv_heads=2, head_dim=8), batch_size=8, seq_len=16)


def analytic_param_bytes(m: ModelConfig, fsdp: int, tensor: int) -> float:
    """fp32 bytes per device under the default rules: every matrix splits over fsdp (embed)
    and tensor (vocab, heads, kv_heads, mlp); norm scales split over fsdp only."""
    D, N, K, H, F, V, L = (m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim,
                           m.vocab_size, m.num_layers)
    matrices = 2 * V * D + L * (2 * D * N * H + 2 * D * K * H + 3 * D * F)
    biases = L * (N + 2 * K) * H if m.qkv_bias else 0  # (heads, head_dim): tensor only
    norms = (2 * L + 1) * D
    return 4 * (matrices / (fsdp * tensor) + biases / tensor + norms / fsdp)


def planned(cfg, mesh_cfg, devices=8):
    cfg = dataclasses.replace(cfg, mesh=mesh_cfg)
    return plan.plan(cfg, make_mesh(mesh_cfg, jax.devices()[:devices]), ("H100", "MI300X"))


@pytest.mark.parametrize("mesh_cfg", [MeshConfig(fsdp=8), MeshConfig(data=2, fsdp=2, tensor=2)])
def test_tiny_plan_matches_analytic_counts(mesh_cfg):
    r = planned(TINY, mesh_cfg)
    expected = analytic_param_bytes(TINY.model, mesh_cfg.fsdp, mesh_cfg.tensor)
    assert r["parameter_bytes"] == expected
    assert r["optimizer_bytes"] == pytest.approx(2 * expected, abs=8)  # Adam's mu, nu (+ counts)
    # Dot FLOPs counted through the scanned layers equal 6N + attention (PaLM) per device.
    assert r["flops"] == pytest.approx(r["model_flops"], rel=0.03)
    # fsdp: each device sends its shard of every gathered weight to the n-1 others at least once.
    assert r["collectives"]["all-gather"]["bytes"] >= expected * (mesh_cfg.fsdp - 1)
    assert r["collective_bytes"] > 0 and r["peak_bytes"] >= r["parameter_bytes"] + r["optimizer_bytes"]
    h100 = r["hardware"]["H100"]
    assert h100["step_s"] == pytest.approx(max(h100["compute_s"], h100["memory_s"]) + h100["collective_s"])
    assert h100["mfu"] == pytest.approx(r["model_flops"] / h100["step_s"] / 989e12)
    assert h100["fits"] and r["estimate_bytes"] > r["parameter_bytes"] and r["memory_fraction"] == 0.9


def test_one_device_moves_no_collective_bytes():
    r = planned(TINY, MeshConfig(fsdp=1), devices=1)
    assert r["collective_bytes"] == 0 and all(c["count"] == 0 for c in r["collectives"].values())
    assert r["parameter_bytes"] == analytic_param_bytes(TINY.model, 1, 1)


@pytest.mark.parametrize("name", ["llama8b", "qwen2_7b"])
def test_full_size_parameter_bytes_from_layouts(name):
    # No compile at this size (that is the 64-device command line's job): the planner's
    # byte count over the state's shardings, against the analytic formula.
    cfg = load(name)
    for mesh_cfg in (MeshConfig(fsdp=8), MeshConfig(fsdp=4, tensor=2)):
        prog = program.build(dataclasses.replace(cfg, mesh=mesh_cfg), make_mesh(mesh_cfg))
        got = plan.state_bytes(prog.state.params, prog.state_shardings.params)
        assert got == pytest.approx(analytic_param_bytes(cfg.model, mesh_cfg.fsdp, mesh_cfg.tensor))
    assert sum(l.bytes for l in prog.layouts) / 4 == pytest.approx(
        {"llama8b": 8.03e9, "qwen2_7b": 7.62e9}[name], rel=0.005)  # published sizes


def test_hlo_collective_conventions():
    text = """HloModule m
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %g = f32[16,8]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %w = f32[8,8]{1,0} constant({...})
  %d = f32[16,8]{1,0} dot(%g, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %x)
}
ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %r = f32[4,8]{1,0} all-reduce(%x), channel_id=2, replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add
  %s = f32[1,8]{1,0} reduce-scatter(%r), channel_id=3, replica_groups={}, dimensions={0}, to_apply=%add
  %w = (s32[], f32[4,8]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %c = f32[4,8]{1,0} collective-permute(%x), channel_id=4, source_target_pairs={{0,1}}
}
"""
    s = hlo.summarize(text, devices=8)
    c = {k: v["bytes"] for k, v in s["collectives"].items()}
    S = 4 * 8 * 4  # operand bytes
    assert c["all-gather"] == 5 * S * 3  # group of 4, inside a loop of 5
    assert c["all-reduce"] == 2 * S * 1 / 2
    assert c["reduce-scatter"] == S * 7 / 8  # replica_groups={}: all 8 devices
    assert c["collective-permute"] == S and c["all-to-all"] == 0
    assert s["collectives"]["all-gather"]["count"] == 5
    assert s["flops"] == 5 * 2 * 16 * 8 * 8
    assert s["matmul_bytes"] == 5 * 4 * (16 * 8 + 8 * 8 + 16 * 8)


def test_bad_input_names_the_flag(capsys):
    with pytest.raises(ConfigError, match=r"--mesh='data=2,fsdp=8' has 16 devices but --devices=64"):
        plan.parse_mesh("data=2,fsdp=8", 64)
    with pytest.raises(ConfigError, match=r"'model=4' is not AXIS=SIZE"):
        plan.parse_mesh("model=4,fsdp=2", 8)
    assert run(plan_main, ["--config", "tiny", "--devices", "8", "--hardware", "H100,TPUv5"]) == 2
    assert "--hardware='TPUv5'" in capsys.readouterr().err
    assert run(plan_main, ["--config", "tiny", "--devices", "8", "--mesh", "tensor=8"]) == 2
    assert "config.model.num_heads=4 does not split over config.mesh.tensor=8" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"names fsdp twice"):
        plan.parse_mesh("fsdp=4,fsdp=2", 2)
    # Without --devices, meshes that name every size give the count (they used to be refused).
    assert plan.mesh_devices(["fsdp=4", "data=2,fsdp=2"]) == 4
    with pytest.raises(ConfigError, match=r"different device counts \('fsdp=4' has 4, 'fsdp=8' has 8\).*--devices N"):
        plan.mesh_devices(["fsdp=4", "fsdp=8"])


def test_fits_means_the_trainer_would_start_it_too():
    """`fits` compared only XLA's peak with all of the memory; hetjax.train compares its
    analytic estimate with config.memory_fraction of it, and refused layouts planned to fit."""
    hw = hardware.get("H100")
    report = {"flops": 1e12, "matmul_bytes": 1e9, "collective_bytes": 1e9, "model_flops": 1e12,
              "peak_bytes": 0.5 * hw.memory_bytes, "estimate_bytes": 0.95 * hw.memory_bytes, "memory_fraction": 0.9}
    e = plan.estimate_step(report, hw)
    assert (e["fits"], e["fits_peak"], e["fits_estimate"]) == (False, True, False)
    assert plan.fits_text(e) == "no (est)"
    e = plan.estimate_step({**report, "peak_bytes": 1.1 * hw.memory_bytes}, hw)
    assert plan.fits_text(e) == "no (peak,est)"
    e = plan.estimate_step({**report, "estimate_bytes": 0.85 * hw.memory_bytes}, hw)
    assert e["fits"] and plan.fits_text(e) == "yes"
    # Of the memory jax's GPU allocator takes (its bytes_limit, 0.75 by default), as the trainer reads it.
    e = plan.estimate_step({**report, "estimate_bytes": 0.7 * hw.memory_bytes, "allocator_fraction": 0.75}, hw)
    assert plan.fits_text(e) == "no (est)"


def test_the_planner_refuses_what_the_trainer_refuses_before_compiling(tmp_path, capsys, monkeypatch):
    """It used to print `fits yes` for meshes that `hetjax.train` then refused."""
    monkeypatch.setattr(plan, "plan", lambda *a: pytest.fail("compiled a mesh the trainer refuses"))
    common = ["--config", "tiny", "--devices", "8", "--out", str(tmp_path / "out")]
    # No --devices: the meshes give 8 (tiny's config.mesh has fsdp=-1, which gives none).
    assert run(plan_main, ["--config", "tiny", "--out", str(tmp_path / "out"), "--mesh", "fsdp=8;pipeline=2,fsdp=4",
                           "--config.optim.grad_accum_steps=2"]) == 2
    assert "config.optim.grad_accum_steps=2 with config.mesh.pipeline=2" in capsys.readouterr().err
    assert run(plan_main, [*common, "--mesh", "pipeline=8", "--config.model.num_layers=8",
                           "--config.pipeline.microbatches=8", "--config.sharding.max_replicated_fraction=0.01"]) == 2
    assert "config.sharding.max_replicated_fraction" in capsys.readouterr().err
    # A config of islands: the plan of one fsdp mesh would describe no program the job runs.
    assert run(plan_main, ["--config", "tiny_hetero", "--devices", "4", "--out", str(tmp_path / "out")]) == 2
    assert "config.hetero.islands (cuda, rocm): python -m hetjax.plan works on one mesh" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert run(plan_main, ["--config", "tiny", "--devices", "8", "--out", str(tmp_path / "afile")]) == 2
    assert "--out=" in capsys.readouterr().err


def test_sweep_on_more_devices_in_a_fresh_process(tmp_path):
    # 16 virtual devices: more than this test process has, so the planner starts its own.
    env = cpu_env(None)  # no device count (the planner sets its own), the suite's other XLA flags
    proc = subprocess.run(
        [sys.executable, "-m", "hetjax.plan", "--config", "tiny", "--devices", "16", "--mesh",
         "fsdp=16;data=2,fsdp=4,tensor=2", "--config.model.num_layers=1", "--out", str(tmp_path)],
        env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = json.loads((tmp_path / "plan.json").read_text())
    assert [r["devices"] for r in reports] == [16, 16] and (tmp_path / "plan.png").stat().st_size > 0
    assert reports[0]["mesh"]["fsdp"] == 16 and "MI300X" in proc.stdout and "fsdp=16" in proc.stdout
    m = load("tiny").model
    assert reports[0]["parameter_bytes"] == analytic_param_bytes(dataclasses.replace(m, num_layers=1), 16, 1)
    assert metrics.PEAK_FLOPS["H100"] == 989e12  # one table for MFU and the planner


def test_a_conditional_counts_its_costliest_branch_once_per_call():
    """A pipeline's tick loop runs one branch of its conditional per trip; counting every
    branch made a pipeline mesh's FLOPs about 5x too high."""
    text = """HloModule m
%light (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} constant({...})
  ROOT %d = f32[4,8]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
%heavy (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} constant({...})
  %d = f32[4,8]{1,0} dot(%p, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %e = f32[4,8]{1,0} dot(%d, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %c = f32[4,8]{1,0} collective-permute(%e), channel_id=1, source_target_pairs={{0,1}}
}
%idle (p: f32[4,8]) -> f32[4,8] {
  ROOT %p = f32[4,8]{1,0} parameter(0)
}
%body (t: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %t = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%t), index=1
  %y = f32[4,8]{1,0} conditional(%i, %x, %x, %x), branch_computations={%light, %heavy, %idle}
  ROOT %r = (s32[], f32[4,8]{1,0}) tuple(%i, %y)
}
ENTRY %main (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  ROOT %w = (s32[], f32[4,8]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
}
"""
    s = hlo.summarize(text, devices=2)
    one_dot = 2 * 4 * 8 * 8
    assert s["flops"] == 6 * 2 * one_dot  # the heavy branch, 6 times; not all three branches
    assert s["collectives"]["collective-permute"] == {"count": 6, "bytes": 6 * 4 * 8 * 4}


def test_a_device_kind_is_matched_to_its_own_data_sheet():
    """"GH200" contains "H200": the longest name that matches wins."""
    assert hardware.for_device_kind("NVIDIA GH200 480GB").name == "GH200"
    assert hardware.for_device_kind("NVIDIA H200").name == "H200"
    assert hardware.for_device_kind("NVIDIA H100 80GB HBM3").name == "H100"
    # The PCIe cards were measured against the SXM module's 989 TFLOP/s (data sheets: 1,513
    # and 1,671 with sparsity, half that dense).
    assert hardware.for_device_kind("NVIDIA H100 PCIe").peak_flops == 756e12
    assert hardware.for_device_kind("NVIDIA H100 NVL").peak_flops == 835e12
    assert hardware.for_device_kind("AMD Instinct MI300X").name == "MI300X"
    assert hardware.for_device_kind("cpu") is None
