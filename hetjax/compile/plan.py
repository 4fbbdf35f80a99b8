"""A sharding plan's cost before booking a cluster: compile the step abstractly, read
per-device memory, FLOPs and collective traffic, and estimate the step on named hardware.

The step time is a roofline without overlap: max(FLOPs / peak, matmul bytes /
HBM bandwidth) + collective bytes / interconnect bandwidth (see hetjax.compile.hlo
for what is counted). Real programs overlap
collectives with compute, so this is an upper bound on time (a lower bound on MFU)
when the interconnect figure holds, i.e. within one node.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax

from hetjax import memory, metrics, program
from hetjax.compile import aot, hardware, hlo
from hetjax.errors import ConfigError
from hetjax.mesh import MESH_AXES, MeshConfig

DEFAULT_HARDWARE = hardware.DEFAULT_HARDWARE


def parse_mesh(text: str, devices: int | None, flag: str = "--mesh") -> MeshConfig:
    """'data=2,fsdp=8,tensor=4' -> MeshConfig (unnamed axes are 1), checked against `devices`
    unless None."""
    sizes = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        axis, eq, value = part.partition("=")
        if axis not in MESH_AXES or not eq:
            raise ConfigError(f"{flag}={text!r}: {part!r} is not AXIS=SIZE with AXIS one of {MESH_AXES}")
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{flag}={text!r}: {axis}={value!r} must be a positive integer")
        if axis in sizes:
            raise ConfigError(f"{flag}={text!r} names {axis} twice: give each axis once")
        sizes[axis] = int(value)
    sizes = {a: sizes.get(a, 1) for a in MESH_AXES}
    if devices is not None and math.prod(sizes.values()) != devices:
        raise ConfigError(
            f"{flag}={text!r} has {math.prod(sizes.values())} devices but --devices={devices}; "
            f"make the sizes multiply to {devices}")
    return MeshConfig(**sizes)


def mesh_devices(texts: list[str], flag: str = "--mesh") -> int:
    """The device count the meshes `texts` name: each gives every axis a size (unnamed
    ones are 1), so --devices may be left out when they agree."""
    counts = {t: math.prod(dataclasses.astuple(parse_mesh(t, None, flag))) for t in texts}
    if len(set(counts.values())) > 1:
        named = ", ".join(f"{t!r} has {n}" for t, n in counts.items())
        raise ConfigError(f"{flag}: the meshes name different device counts ({named}); a sweep plans one "
                          f"device count: give meshes of one size, with --devices N")
    return next(iter(counts.values()))


def state_bytes(abstract_tree, shardings) -> float:
    """Bytes one device holds of `abstract_tree` laid out by `shardings` (the largest shard)."""
    total = 0.0
    for x, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings), strict=True):
        total += math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
    return total


def estimate_step(report: dict, hw: hardware.Hardware) -> dict:
    compute = report["flops"] / hw.peak_flops
    mem = report["matmul_bytes"] / hw.hbm_bandwidth
    comm = report["collective_bytes"] / hw.interconnect_bandwidth
    step_time = max(compute, mem) + comm
    # Both must hold: XLA's peak within the device's memory, and the trainer's own check
    # (hetjax.memory.check_fits: its analytic estimate within config.memory_fraction of the
    # memory), which refuses a run before it compiles; a plan must not recommend what
    # hetjax.train refuses.
    usable = report.get("allocator_fraction", 1.0) * hw.memory_bytes
    fits_peak = report["peak_bytes"] <= usable
    fits_estimate = report["estimate_bytes"] <= report["memory_fraction"] * usable
    return {"compute_s": compute, "memory_s": mem, "collective_s": comm, "step_s": step_time,
            "mfu": report["model_flops"] / step_time / hw.peak_flops,
            "fits": fits_peak and fits_estimate, "fits_peak": fits_peak, "fits_estimate": fits_estimate}


def fits_text(e: dict) -> str:
    """'yes', or 'no' and which test failed: XLA's peak, the trainer's estimate, or both."""
    failed = [name for name, key in (("peak", "fits_peak"), ("est", "fits_estimate")) if not e[key]]
    return "yes" if not failed else f"no ({','.join(failed)})"


def check_as_the_trainer_does(cfg, mesh) -> program.Program:
    """The trainer's checks of a layout that come after config validation (the model
    splits over the mesh; not too many parameter bytes left unsplit), without compiling;
    the abstract program they build, for plan()."""
    from hetjax import sharding
    prog = program.build(cfg, mesh)
    sharding.check_replication(prog.layouts, mesh, cfg.sharding.max_replicated_fraction)
    return prog


def plan(cfg, mesh, hardware_names=DEFAULT_HARDWARE, prog: program.Program | None = None) -> dict:
    """Compiles `cfg`'s train step on `mesh` with abstract inputs; per-device figures.
    `prog`: program.build(cfg, mesh), when already built."""
    hws = [hardware.get(n) for n in hardware_names]
    prog = prog or program.build(cfg, mesh)
    compiled = prog.compile_train_step()
    in_shardings = compiled.input_shardings[0][0]  # the TrainState's, as compiled
    compiler = aot.analysis(compiled)
    counted = hlo.summarize(compiled.as_text(), mesh.size)
    num_params = metrics.num_params(cfg.model)  # not prog.layouts: a pipeline's hold padding
    tokens = cfg.batch_size * cfg.seq_len
    params = state_bytes(prog.state.params, in_shardings.params)
    est = memory.estimate(cfg, prog.layouts, mesh)
    report = {
        "config": cfg.name, "mesh": dict(mesh.shape), "devices": mesh.size,
        "num_params": num_params, "tokens_per_step": tokens,
        "parameter_bytes": params,
        "optimizer_bytes": state_bytes(prog.state.opt_state, in_shardings.opt_state),
        "gradient_bytes": params,  # one gradient per parameter, same dtype and layout
        "activation_bytes": est.activations,  # analytic
        "estimate_bytes": est.total,  # what hetjax.train's memory check compares, analytic
        "memory_fraction": cfg.memory_fraction,
        # jax's GPU allocator takes this share of a device (its bytes_limit, which the
        # trainer's check reads), not all of it.
        "allocator_fraction": float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75)),
        "temp_bytes": compiler["temp_bytes"],  # compiler: activations, gradients, scratch
        "peak_bytes": compiler["peak_bytes"],
        "flops": counted["flops"],
        "model_flops": metrics.model_flops_per_token(cfg, num_params) * tokens / mesh.size,
        "matmul_bytes": counted["matmul_bytes"],
        "collectives": counted["collectives"],
        "collective_bytes": sum(c["bytes"] for c in counted["collectives"].values()),
    }
    report["hardware"] = {hw.name: estimate_step(report, hw) for hw in hws}
    return report


def table(reports: list[dict]) -> str:
    """The terminal table: one row per (mesh, hardware)."""
    gib = memory.GiB
    head = (f"{'mesh':<28} {'params':>7} {'optim':>7} {'activ':>7} {'temp':>7} {'peak':>7} "
            f"{'TFLOP':>8} {'AG GB':>7} {'RS GB':>7} {'AR GB':>7} {'A2A GB':>7} {'CP GB':>7} "
            f"{'hw':>7} {'step s':>8} {'MFU':>6} {'fits':>13}")
    lines = [head, "-" * len(head)]
    for r in reports:
        mesh = ",".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "1 device"
        c = r["collectives"]
        left = (f"{mesh:<28} " + " ".join(f"{r[k] / gib:7.2f}" for k in (
            "parameter_bytes", "optimizer_bytes", "activation_bytes", "temp_bytes", "peak_bytes"))
            + f" {r['flops'] / 1e12:8.1f} " + " ".join(f"{c[k]['bytes'] / 1e9:7.2f}" for k in hlo.COLLECTIVES))
        for i, (name, e) in enumerate(r["hardware"].items()):
            lines.append((left if i == 0 else " " * len(left))
                         + f" {name:>7} {e['step_s']:8.3f} {e['mfu']:6.1%} {fits_text(e):>13}")
    lines.append("per device, GiB / TFLOP / GB per step; activations analytic, temp and peak from the "
                 "compiler (CPU); step = max(compute, HBM) + collectives, no overlap; fits: the "
                 f"compiled peak within the {reports[0]['allocator_fraction']:g} of the memory jax's allocator "
                 f"takes (XLA_PYTHON_CLIENT_MEM_FRACTION) and the trainer's estimate (hetjax.memory) within "
                 f"config.memory_fraction={reports[0]['memory_fraction']} of that")
    return "\n".join(lines)


def plot(reports: list[dict], path) -> None:
    """Per-device memory (stacked) and estimated MFU per hardware, one group per mesh."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [",".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "1" for r in reports]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(6 + 1.2 * len(reports), 4.5))
    bottom = [0.0] * len(reports)
    for key in ("parameter_bytes", "optimizer_bytes", "activation_bytes"):
        values = [r[key] / memory.GiB for r in reports]
        ax1.bar(names, values, bottom=bottom, label=key.removesuffix("_bytes"))
        bottom = [b + v for b, v in zip(bottom, values)]
    ax1.plot(names, [r["peak_bytes"] / memory.GiB for r in reports], "k_", markersize=20, label="compiled peak")
    ax1.set_ylabel("GiB per device")
    ax1.legend(fontsize=8)
    hws = list(reports[0]["hardware"])
    width = 0.8 / len(hws)
    for i, hw in enumerate(hws):
        ax2.bar([j + i * width for j in range(len(reports))],
                [100 * r["hardware"][hw]["mfu"] for r in reports], width, label=hw)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(reports))], names)
    ax2.set_ylabel("estimated MFU (%)")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(f"{reports[0]['config']} on {reports[0]['devices']} devices")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
