"""What the per-step figures count: the parameters and FLOPs of the model itself, the
whole job's peak, step times without the loop's pauses, both token rates, which rows
carry a warm-up, and the activation bytes the memory check expects."""

import dataclasses
import json
import os
import time

import jax
import pytest

from hetjax import config as config_lib
from hetjax import memory, metrics, plot, program
from hetjax.compile import hardware
from hetjax.hetero import peaks
from hetjax.config import MeshConfig
from hetjax.mesh import make_mesh


def tiny(**model):
    cfg = config_lib.load("tiny")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **model))


def tiny_params_by_hand(layers: int) -> int:
    """tiny's parameters (embed 64, mlp 192, 4 heads and 2 kv heads of 16, vocab 256)."""
    q = o = 64 * 4 * 16
    k = v = 64 * 2 * 16
    per_layer = q + k + v + o + 3 * 64 * 192 + 2 * 64  # attention, SwiGLU, two norm scales
    return layers * per_layer + 2 * 256 * 64 + 64  # embedding, output head, final norm


def estimate_and_peak(cfg, devices=None):
    """(the memory estimate, XLA's peak bytes per device, the mesh) of cfg's compiled step."""
    from hetjax.compile import aot
    config_lib.validate(cfg)
    mesh = make_mesh(cfg.mesh, devices)
    prog = program.build(cfg, mesh)
    return memory.estimate(cfg, prog.layouts, mesh), aot.analysis(prog.compile_train_step())["peak_bytes"], mesh


# -- a pipeline's padding layers are not the model's --------------------------------------


@pytest.mark.parametrize("stage_layers", [(), (3, 1)])
def test_uneven_pipeline_stages_count_the_models_parameters_and_flops_not_their_padding(
        stage_layers, monkeypatch):
    from hetjax.job import MeshJob
    # (3, 1) pads the 4 layers to 3 slots per stage: 6 in the stacked parameters.
    cfg = tiny(num_layers=4)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, pipeline=2),
                              # (an even split would interleave by default: 1 compares like with like)
                              pipeline=dataclasses.replace(cfg.pipeline, stage_layers=stage_layers, virtual_stages=1))
    config_lib.validate(cfg)
    mesh = make_mesh(cfg.mesh)
    prog = program.build(cfg, mesh)
    slots = {l.shape[0] for l in prog.layouts if l.logical[0] == "layers"}
    assert slots == {6 if stage_layers else 4}
    monkeypatch.setattr(program.Program, "compile_train_step", lambda self: None)  # counting only
    job = MeshJob(cfg, None, compile_only=True, log=lambda line: None)
    assert job.num_params == tiny_params_by_hand(4)
    lookup = 256 * 64
    attention = 12 * 4 * 4 * 16 * cfg.seq_len
    assert job.flops_per_step() == (6 * (tiny_params_by_hand(4) - lookup) + attention) * cfg.batch_size * cfg.seq_len
    # The memory check's "one more layer" hint: one slot's bytes per device, padding or not.
    unpadded = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, stage_layers=()))
    assert (memory.estimate(cfg, prog.layouts, mesh).per_layer
            == memory.estimate(unpadded, program.build(unpadded, mesh).layouts, mesh).per_layer)


# -- islands as separate processes: MFU over the whole job's peak --------------------------


class Device:
    def __init__(self, kind: str, platform: str = "gpu"):
        self.device_kind, self.platform = kind, platform


def islands_mfus(cfg, island_devices: list[list]) -> tuple[float, list[float]]:
    """The MFU of a 1-second step of 1e15 FLOPs (the whole job's, in either mode) over
    hetero.job's peak: (virtual islands', [each island process's]). A process holds one
    island; the links' exchange (simulated) brings each other island's own peak."""
    virtual, _ = peaks.peak_of_job(cfg, island_devices)
    processes = []
    for k, mine in enumerate(island_devices):
        def exchange(value, k=k):
            return [value if j == k else peaks.island_peak(cfg, devices)
                    for j, devices in enumerate(island_devices)]
        processes.append(1e15 / peaks.peak_of_job(cfg, [mine], exchange)[0])
    return 1e15 / virtual, processes


def test_island_processes_measure_mfu_against_the_whole_jobs_peak_as_virtual_islands_do(monkeypatch):
    cfg = dataclasses.replace(config_lib.load("tiny_hetero"), peak_tflops=2.0)
    cpus = jax.devices()
    virtual, processes = islands_mfus(cfg, [cpus[:2], cpus[2:8]])
    assert virtual == pytest.approx(1e15 / (2e12 * 8))  # config.peak_tflops for each of 8 devices
    assert processes == pytest.approx([virtual, virtual])

    # Islands of different device kinds, each peak from its own data sheet.
    cfg = config_lib.load("tiny_hetero")
    h100, mi300x = [Device("NVIDIA H100 80GB HBM3")] * 4, [Device("AMD Instinct MI300X", "rocm")] * 2
    virtual, processes = islands_mfus(cfg, [h100, mi300x])
    sheets = 4 * hardware.TABLE["H100"].peak_flops + 2 * hardware.TABLE["MI300X"].peak_flops
    assert virtual == pytest.approx(1e15 / sheets)
    assert processes == pytest.approx([virtual, virtual])

    # CPU islands on one host share its cores: its measured rate is the whole peak, as
    # it is for one mesh of virtual CPU devices.
    monkeypatch.setattr(metrics, "measure_cpu_matmul_flops", lambda: 1e11)
    virtual, processes = islands_mfus(cfg, [cpus[:2], cpus[2:4]])
    assert virtual == pytest.approx(1e15 / metrics.peak_flops(cfg, cpus[:4])[0]) == pytest.approx(1e4)
    assert processes == pytest.approx([virtual, virtual])
    on_two_hosts = [{"peak": 1e11, "source": "measured", "host": h} for h in ("a", "b", "b")]
    assert peaks.job_peak(on_two_hosts)[0] == 2e11

    # A process pinned to a share of the cores (launch.local's islands and processes)
    # measures that share; the host's peak is the whole, as above. Pinned for real here.
    everything = os.sched_getaffinity(0)
    if len(everything) > 1:
        monkeypatch.setenv(metrics.HOST_CPUS_VARIABLE, str(len(everything)))  # as launch.local sets it
        try:
            os.sched_setaffinity(0, {min(everything)})
            peak, source = metrics.peak_flops(cfg, cpus[:2])
        finally:
            os.sched_setaffinity(0, everything)
        assert peak == pytest.approx(1e11 * len(everything)), source
        assert f"on 1 of this host's {len(everything)} cores" in source


# -- the activation estimate against XLA's own figure ---------------------------------------


@pytest.mark.parametrize("remat", ["dots", "none"])
def test_the_activation_estimate_follows_xlas_temp_bytes_as_the_sequence_grows(remat):
    # XLA's attention keeps (batch, heads, T, T) logits in fp32; under remat="dots" they
    # are saved for every layer, so the estimate must grow with T as the compiled step does.
    # (fp32 only: what XLA:CPU keeps of a bf16 program is not what a GPU keeps.)
    for seq_len in (128, 512):
        cfg = dataclasses.replace(tiny(num_heads=8, remat=remat, attention_impl="xla"), batch_size=2,
                                  seq_len=seq_len, mesh=dataclasses.replace(config_lib.load("tiny").mesh, fsdp=1))
        mesh = make_mesh(cfg.mesh, jax.devices()[:1])
        prog = program.build(cfg, mesh)
        est = memory.estimate(cfg, prog.layouts, mesh)
        temp = prog.compile_train_step().memory_analysis().temp_size_in_bytes  # gradients and activations
        assert est.activations + est.gradients == pytest.approx(temp, rel=0.15), (seq_len, temp)


def test_the_cudnn_activation_estimate_counts_what_jax_saves_for_the_backward(monkeypatch):
    """cuDNN's fused attention saves its output and fp32 softmax statistics, not the
    logits. Under remat="dots" the estimate is exactly the residuals jax saves per layer and
    token; under "none" it counts the statistics too (they were left out there, and counted
    under "dots" only). Traced, not run: no cuDNN here, so its version check is skipped."""
    import jax._src.cudnn.fused_attention_stablehlo as fused
    import jax.numpy as jnp
    from flax import nnx
    from jax._src.ad_checkpoint import saved_residuals

    from hetjax.models.llama import Decoder
    monkeypatch.setattr(fused, "check_cudnn_version", lambda *a, **k: None)
    monkeypatch.setattr(fused, "check_compute_capability", lambda *a, **k: True)
    B, T = 2, 16

    def config(remat, impl="cudnn"):
        return dataclasses.replace(tiny(dtype="bfloat16", attention_impl=impl, remat=remat), batch_size=B, seq_len=T)

    def per_layer_token(remat):  # jax's saved residuals, the statistics among them, the estimate
        cfg = config(remat)
        m = cfg.model
        graphdef, params = nnx.split(Decoder(m, rngs=nnx.Rngs(0)))
        loss = lambda p: nnx.merge(graphdef, p)(jnp.zeros((B, T), jnp.int32)).astype(jnp.float32).sum()
        saved = [a for a, why in saved_residuals(loss, params) if "apply_layers" in why]  # the layers' scan
        stats = [a for a in saved if a.dtype == jnp.float32 and a.shape == (m.num_layers, B, m.num_heads, T)]
        per = lambda avals: sum(a.size * a.dtype.itemsize for a in avals) / (m.num_layers * B * T)
        return per(saved), per(stats), memory._activation_bytes_per_layer_token(cfg, memory.Splits(), remat)

    saved, stats, estimate = per_layer_token("dots")
    assert stats > 0 and estimate == saved
    _, stats_none, with_stats = per_layer_token("none")
    assert stats_none == stats  # saved under "none" too
    xla = config("none", "xla")  # the same layer with XLA's attention, less its logits and probabilities
    assert with_stats == memory._activation_bytes_per_layer_token(xla, memory.Splits(), "none") - memory._attention_scores(xla, memory.Splits()) + stats


@pytest.mark.parametrize("virtual", [1, 0], ids=["uninterleaved", "automatic: 2 chunks"])
def test_a_pipelines_activation_estimate_counts_its_micro_batches_and_stages(virtual):
    """A stage holds 1/S of the layers and works on one micro-batch at a time, stashing the
    inputs of those in flight. Before, the estimate counted every layer at the whole batch
    (4.4x XLA's figure here), and the memory check refused pipelines that fit."""
    cfg = dataclasses.replace(tiny(num_layers=4, embed_dim=256, mlp_dim=768, num_heads=8, num_kv_heads=4,
                                   head_dim=32, vocab_size=4096), batch_size=32, seq_len=256,
                              mesh=dataclasses.replace(config_lib.load("tiny").mesh, pipeline=2, fsdp=4),
                              pipeline=dataclasses.replace(config_lib.load("tiny").pipeline, microbatches=4,
                                                           virtual_stages=virtual))
    config_lib.validate(cfg)
    mesh = make_mesh(cfg.mesh)
    prog = program.build(cfg, mesh)
    est = memory.estimate(cfg, prog.layouts, mesh)
    temp = prog.compile_train_step().memory_analysis().temp_size_in_bytes
    assert est.activations + est.gradients == pytest.approx(temp, rel=0.2), (est, temp)


@pytest.mark.parametrize("accum", [1, 4])
def test_an_fsdp_estimate_counts_the_gathered_weights_and_the_accumulated_gradients(accum):
    """A model heavy in parameters (a 32k vocabulary) under fsdp=8: each device gathers the
    embedding and the head whole, and a layer at a time, and gradient accumulation keeps a
    sum beside each micro-step's gradients. Before, the estimate was 0.46 (0.34 with
    accumulation) of XLA's peak, and the memory check let through what could not fit."""
    cfg = dataclasses.replace(tiny(num_layers=4, embed_dim=512, mlp_dim=2048, num_heads=8, num_kv_heads=4,
                                   head_dim=64, vocab_size=32000), batch_size=8 * accum, seq_len=16,
                              optim=dataclasses.replace(config_lib.load("tiny").optim, grad_accum_steps=accum))
    est, peak, mesh = estimate_and_peak(cfg)
    assert mesh.shape["fsdp"] == 8
    assert est.total == pytest.approx(peak, rel=0.2), (est, peak)


def test_an_activation_estimate_splits_each_mesh_axis_once_as_the_model_does():
    """Sequence over tensor (rules mapping `length` to tensor): a mesh axis splits only the
    first dimension that names it, so heads and mlp activations are not split by tensor
    again. The estimate divided them by it twice: 0.53 of XLA's peak, and the memory check
    let through what could not fit."""
    from hetjax.sharding import DEFAULT_RULES
    cfg = dataclasses.replace(tiny(num_layers=4, embed_dim=256, mlp_dim=1024, num_heads=8, num_kv_heads=4,
                                   head_dim=32, vocab_size=1024), batch_size=8, seq_len=256, mesh=MeshConfig(fsdp=2, tensor=2))
    cfg = dataclasses.replace(cfg, sharding=dataclasses.replace(
        cfg.sharding, rules=tuple((k, "tensor" if k == "length" else v) for k, v in DEFAULT_RULES)))
    est, peak, _ = estimate_and_peak(cfg, jax.devices()[:4])
    assert est.total == pytest.approx(peak, rel=0.2), (est, peak)


@pytest.mark.parametrize("layers", [8, 6])
def test_a_pipelines_does_not_fit_hint_names_a_layer_count_that_fits_and_splits(layers):
    """A stage holds 1/S of the layers: counting every layer's activations on each device,
    the hint for 8 layers on 2 stages over budget was 6 layers (which did not fit); then 5
    (which two stages cannot split). 8 layers run 2 automatic chunks per stage, 6 run 1; a
    hint of 4 layers for those 6 would run 2 unless it says virtual_stages=1, the estimate's."""
    import re
    base = config_lib.load("tiny")

    def estimate(layers, gib=0.0, virtual=0):
        cfg = dataclasses.replace(
            tiny(num_layers=layers, embed_dim=256, mlp_dim=1024, num_heads=8, num_kv_heads=4, head_dim=32),
            batch_size=16, seq_len=256, mesh=MeshConfig(pipeline=2, fsdp=2), device_memory_gib=gib,
            pipeline=dataclasses.replace(base.pipeline, microbatches=4, virtual_stages=virtual))
        config_lib.validate(cfg)
        mesh = make_mesh(cfg.mesh, jax.devices()[:4])
        prog = program.build(cfg, mesh)
        return cfg, memory.estimate(cfg, prog.layouts, mesh), mesh, prog.plan.layout.virtual
    cfg, est, mesh, chunks = estimate(layers)
    assert chunks == (2 if layers == 8 else 1)
    gib = (0.75 if layers == 8 else 0.9) * est.total / memory.GiB / cfg.memory_fraction  # 6: room for 4
    cfg, est, mesh, _ = estimate(layers, gib)
    with pytest.raises(memory.DoesNotFit, match=r"--config.model.num_layers=(\d+)") as refused:
        memory.check_fits(cfg, est, mesh)
    hinted = int(re.search(r"num_layers=(\d+)", str(refused.value)).group(1))
    pinned = re.search(r"--config.pipeline.virtual_stages=(\d+)", str(refused.value))
    assert hinted % (2 * chunks) == 0 and hinted >= 2
    assert (pinned is not None) == (chunks == 1), str(refused.value)  # 6 layers: a hint of 4
    cfg, est, mesh, ran = estimate(hinted, gib, int(pinned.group(1)) if pinned else 0)
    assert ran == chunks
    memory.check_fits(cfg, est, mesh)  # fits, as it said


def test_the_does_not_fit_hint_names_a_device_count_the_batch_splits_over():
    """16 rows needing 41 devices' memory were told "about 41 devices", which no mesh can
    split 16 rows over (nor 32, the next fsdp that would hold them)."""
    cfg = dataclasses.replace(tiny(), batch_size=16, seq_len=256, mesh=MeshConfig(fsdp=1))
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    est = memory.estimate(cfg, program.build(cfg, mesh).layouts, mesh)

    def hint(share):  # of the estimate that one device holds
        small = dataclasses.replace(cfg, device_memory_gib=share * est.total / memory.GiB / cfg.memory_fraction)
        with pytest.raises(memory.DoesNotFit) as refused:
            memory.check_fits(small, est, mesh)
        return str(refused.value)
    assert "What would fit: about 4 devices of this size with the model sharded over config.mesh.fsdp" in hint(1 / 3)
    assert "What would fit: not even 16 devices, one row each" in hint(1 / 40)


def test_the_gathered_weights_follow_the_sharding_rules_not_the_fsdp_axis():
    """ZeRO-3 over `data` (config.sharding.rules mapping embed to data, the batch split over
    data) gathers each weight as fsdp does: the estimate equals fsdp=8's, gathered weights
    included. Before, nothing counted as gathered unless config.mesh.fsdp > 1 (the
    embedding, head and a layer left out); and with tensor=2 beside it, only what the rules
    split over tensor stays split while gathered."""
    from hetjax.sharding import DEFAULT_RULES
    model = dict(num_layers=4, embed_dim=512, mlp_dim=2048, num_heads=8, num_kv_heads=4, head_dim=64, vocab_size=32000)
    fsdp = dataclasses.replace(tiny(**model), batch_size=8, seq_len=16)
    over_data = dataclasses.replace(
        fsdp, mesh=MeshConfig(data=-1, fsdp=1),
        sharding=dataclasses.replace(fsdp.sharding, rules=tuple((k, "data" if k == "embed" else v) for k, v in DEFAULT_RULES)))

    def estimate(cfg):
        config_lib.validate(cfg)
        mesh = make_mesh(cfg.mesh)
        return memory.estimate(cfg, program.build(cfg, mesh).layouts, mesh)
    a, b = estimate(fsdp), estimate(over_data)
    m = fsdp.model
    layer = (m.embed_dim * (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim + 3 * m.embed_dim * m.mlp_dim
             + 2 * m.embed_dim) * 4  # fp32 weights of one layer: attention, SwiGLU, two norms
    whole = (2 * m.vocab_size * m.embed_dim + m.embed_dim) * 4  # embedding, head, final norm
    assert a.gathered == b.gathered == pytest.approx(whole + layer, rel=1e-6)
    assert a == b
    tensor = dataclasses.replace(fsdp, mesh=MeshConfig(fsdp=-1, tensor=2))
    norms = (2 * m.embed_dim + m.embed_dim) * 4  # split over fsdp only: gathered whole
    assert estimate(tensor).gathered == pytest.approx((whole + layer - norms) / 2 + norms, rel=1e-6)


# -- one run, resumed: step times, token rates and warm-up rows ----------------------------


SLOW = 1.5  # seconds each parameter fingerprint takes here; a warm-up step of tiny takes ~0.6


def test_step_times_leave_out_fingerprints_and_a_resumed_runs_first_step_is_its_warmup(tmp_path, monkeypatch):
    from hetjax import job as job_lib, train
    fingerprint = job_lib.MeshJob.param_fingerprint

    def slow_fingerprint(self, state):
        time.sleep(SLOW)
        return fingerprint(self, state)
    monkeypatch.setattr(job_lib.MeshJob, "param_fingerprint", slow_fingerprint)
    run_dir = tmp_path / "run"
    args = ["--config", "tiny", f"--config.run_dir={run_dir}", "--config.eval_every=0", "--config.tensorboard=false",
            "--config.checkpoint.every=0", "--config.model.num_layers=1", "--config.fingerprint_every=1"]
    assert train.main([*args, "--config.steps=3"]) == 0
    assert train.main([*args, "--config.steps=5"]) == 0  # resumes from its checkpoint of step 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    fingerprinted = [json.loads(line)["step"] for line in (run_dir / "fingerprints.jsonl").read_text().splitlines()
                     if json.loads(line)["kind"] == "params"]
    assert set(fingerprinted) == {0, 1, 2, 3, 4, 5}  # one before every step
    cfg = config_lib.load("tiny")
    for r in rows:
        assert r["step_time"] < SLOW, r  # a fingerprint before every step, in none of them
        # Every position of the batch (what the MFUs count), and the positions the loss reads.
        assert r["tokens_per_sec"] == pytest.approx(cfg.batch_size * cfg.seq_len / r["step_time"], rel=1e-6)
        assert r["loss_tokens_per_sec"] == pytest.approx(r["tokens"] / r["step_time"], rel=1e-6)  # fp32
        assert 0 < r["tokens"] < cfg.batch_size * cfg.seq_len  # the loss mask leaves some out
    # The first step of each start carries its warm-up; plot leaves exactly those out.
    assert [r["step"] for r in rows if r.get("run_start")] == [0, 3]
    assert [r["warmup"] for r in plot.read_metrics(run_dir)[0]] == [True, False, False, True, False]


def test_plot_flags_the_first_row_of_every_run_a_file_holds(tmp_path):
    def row(step, **extra):
        return {"step": step, "loss": 1.0, "step_time": 0.1, "tokens_per_sec": 1.0, "mfu": 0.1, **extra}
    first, resumed = [row(0, run_start=1.0), row(1), row(2)], [row(3, run_start=1.0), row(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*first, *resumed]))
    assert [r["warmup"] for r in plot.read_metrics(tmp_path)[0]] == [True, False, False, True, False]
    # A file without the marks (older runs): a step that does not follow the one before
    # starts a run; its rows of one step are merged, the restarted one's warm-up kept.
    unmarked = [{k: v for k, v in r.items() if k != "run_start"} for r in [*first, row(2), row(3)]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in unmarked))
    assert [r["warmup"] for r in plot.read_metrics(tmp_path)[0]] == [True, False, True, False]


def test_the_activation_estimate_splits_the_batch_as_the_rules_do():
    """With `batch` mapped to data only, the estimate still divided the activations by
    data x fsdp: 0.27 of XLA's peak, and check_fits would let through what cannot fit."""
    rules = tuple(("batch", "data") if k == "batch" else (k, v) for k, v in config_lib.DEFAULT_RULES)
    cfg = dataclasses.replace(tiny(num_layers=4, embed_dim=256, mlp_dim=1024, num_heads=8, num_kv_heads=8,
                                   head_dim=32, vocab_size=1024), batch_size=16, seq_len=256,
                              mesh=MeshConfig(data=2, fsdp=4),
                              sharding=dataclasses.replace(config_lib.load("tiny").sharding, rules=rules))
    est, peak, _ = estimate_and_peak(cfg)
    assert est.total == pytest.approx(peak, rel=0.2), (est, peak)


@pytest.mark.parametrize("unsplit", [("mlp",), ("heads", "kv_heads")])
def test_each_kind_of_activation_splits_as_its_own_rule_says(unsplit):
    """With `mlp` (or the heads) mapped to no mesh axis while the others go to tensor,
    the estimate still split them by tensor: 0.53 of XLA's peak with mlp unsplit (the
    memory check let through what could not fit), 1.3x with the heads unsplit."""
    rules = tuple((k, None if k in unsplit else v) for k, v in config_lib.DEFAULT_RULES)
    cfg = dataclasses.replace(tiny(num_layers=4, embed_dim=512, mlp_dim=1792, num_heads=8, num_kv_heads=8,
                                   head_dim=64, vocab_size=8192), batch_size=16, seq_len=256,
                              mesh=MeshConfig(fsdp=2, tensor=4),
                              sharding=dataclasses.replace(config_lib.load("tiny").sharding, rules=rules,
                                                           max_replicated_fraction=1.0))
    est, peak, _ = estimate_and_peak(cfg)
    assert est.total == pytest.approx(peak, rel=0.25), (est, peak)
