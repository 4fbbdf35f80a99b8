"""One config trained under several layouts, each compared with the first.

    python -m hetjax.repro check --config tiny --layouts "fsdp=8; fsdp=2,tensor=4; pipeline=2; islands=2"

Each layout runs `python -m hetjax.train` in a fresh process (layouts may need
different device counts: on CPU each gets that many virtual devices) with the
backend profile's deterministic variant, in its own run directory under --out. All
runs start from the same initial weights because they share config.seed; the step-0
parameter digest, which every run records, proves it (a mismatch voids the row).

It prints a table of each layout against the first and draws every layout's loss
gap, step by step, in OUT/loss_gaps.png (with the `plot` extra).

Layout syntax: `axis=size[,axis=size...]` over the mesh axes pipeline, data, fsdp,
tensor; unnamed axes are 1, except fsdp, which takes the remaining devices unless it
is named. `virtual_stages=V` (with pipeline=S) interleaves V chunks of layers per stage
(config.pipeline.virtual_stages), under the config's schedule or, when that one does not
interleave, 1f1b_fused; without it the config's own applies (0, the default: interleaved
where that can run, hetjax.pipeline.config.virtual_stages). `islands=N` asks
hetjax.hetero.layouts.islands_layout(cfg, N) for a Layout; `islands=N,virtual_stages=V`
gives each island V interleaved chunks of layers.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from hetjax import config as config_lib
from hetjax.errors import ConfigError
from hetjax.mesh import MESH_AXES
from hetjax.pipeline.config import VIRTUAL_SCHEDULES
from hetjax.repro import compare as compare_lib

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run the config: `python -m MODULE --config X --config.K=V ...`."""

    name: str
    overrides: dict  # config key -> value (text)
    devices: int | None = None  # virtual CPU devices it needs on a CPU host (None: all there are)
    module: str = "hetjax.train"  # or a launcher that takes the same arguments
    config: str | None = None  # another config file for this layout (None: check's --config)


@dataclasses.dataclass
class Row:
    layout: str
    run_dir: Path
    ok: bool  # the run finished
    report: compare_lib.Report | None  # against the first layout's run

def parse(text: str) -> list[tuple[str, dict[str, int]]]:
    """'fsdp=8; pipeline=2' -> [('fsdp=8', {'fsdp': 8}), ('pipeline=2', {'pipeline': 2})]."""
    out = []
    for item in (t.strip() for t in text.split(";")):
        if not item:
            continue
        sizes = {}
        for part in item.split(","):
            m = re.fullmatch(r"\s*(\w+)\s*=\s*(-?\d+)\s*", part)
            if not m or m.group(1) not in (*MESH_AXES, "islands", "virtual_stages"):
                raise ConfigError(f"--layouts: {part.strip()!r} in {item!r} is not AXIS=SIZE with AXIS one "
                                  f"of {', '.join(MESH_AXES)}, virtual_stages, islands; e.g. 'fsdp=2,tensor=4'")
            if m.group(1) in sizes:
                raise ConfigError(f"--layouts: {item!r} names {m.group(1)} twice; give each axis once")
            sizes[m.group(1)] = int(m.group(2))
        if "islands" in sizes and set(sizes) - {"islands", "virtual_stages"}:
            raise ConfigError(f"--layouts: {item!r}: islands=N takes no mesh axes (the islands choose theirs), "
                              f"only virtual_stages=V")
        out.append((item, sizes))
    if len(out) < 2:
        raise ConfigError(f"--layouts={text!r}: give at least two layouts separated by ';'")
    return out


def layout(name: str, sizes: dict[str, int], cfg, devices: int, config: str = "") -> Layout:
    """The Layout of one --layouts item."""
    if "islands" in sizes:
        try:
            from hetjax.hetero.layouts import islands_layout
        except ImportError as e:
            raise ConfigError(f"--layouts: {name!r} needs hetjax.hetero (islands), which this "
                              f"installation lacks ({e})") from e
        got = islands_layout(cfg, sizes["islands"], config, devices, virtual=sizes.get("virtual_stages", 1))
        return Layout(name, dict(getattr(got, "overrides", got)), getattr(got, "devices", None),
                      getattr(got, "module", "hetjax.train"), getattr(got, "config", None))
    sizes = dict(sizes)
    virtual = sizes.pop("virtual_stages", None)
    mesh = {a: 1 for a in MESH_AXES} | {"fsdp": -1} | sizes
    if -1 not in mesh.values():
        devices = math.prod(mesh.values())
    overrides = {f"mesh.{a}": str(v) for a, v in mesh.items()}
    if virtual is not None:
        overrides["pipeline.virtual_stages"] = str(virtual)
        if virtual > 1 and cfg.pipeline.schedule not in VIRTUAL_SCHEDULES:
            overrides["pipeline.schedule"] = "1f1b_fused"
    return Layout(name, overrides, devices)


def _check_splits(cfg, devices: int) -> None:
    """The trainer's divisibility checks on the layout's mesh, without its devices."""
    from jax.sharding import AbstractMesh
    from hetjax import program
    from hetjax.mesh import resolve_shape
    sizes = resolve_shape(cfg.mesh, devices)
    program.check_splits(cfg, AbstractMesh(tuple(sizes.values()), tuple(sizes)))


def slug(name: str) -> str:
    return re.sub(r"[^\w]+", "_", name.replace("=", "")).strip("_")


def cpu_env(devices: int | None, environ=None) -> dict:
    """The environment of a run on `devices` virtual CPU devices."""
    env = dict(os.environ if environ is None else environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if devices:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    return env


def python_path(environ=None) -> str:
    """PYTHONPATH for a child: this checkout first, then whatever the caller's had (packages
    installed with --target, say)."""
    environ = os.environ if environ is None else environ
    return os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH", "")]))


def run(lay: Layout, config: str, overrides: dict, run_dir: Path, platform: str, timeout: float,
        env: dict | None = None) -> int:
    """Trains one layout in a fresh process (with `env` added to the environment); its
    output goes to run_dir/train.log."""
    args = [sys.executable, "-m", lay.module, "--config", lay.config or config,
            *[f"--config.{k}={v}" for k, v in {**overrides, **lay.overrides}.items()],
            f"--config.run_dir={run_dir}", "--config.compile.deterministic=true"]
    env = {**(cpu_env(lay.devices) if platform == "cpu" else dict(os.environ)), **(env or {})}
    env["PYTHONPATH"] = python_path(env)
    run_dir.mkdir(parents=True, exist_ok=True)  # an existing run resumes (and appends to its log)
    with open(run_dir / "train.log", "a") as log:
        log.write(" ".join(args) + "\n")
        log.flush()
        try:
            return subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\nhetjax.repro check: timed out after {timeout:.0f}s\n")
            return 124


def with_counts(overrides: dict | None, steps: int, fingerprint_every: int, command: str) -> dict:
    """The overrides with the command's --steps and --fingerprint-every; a --config. override
    of either is refused, as it would be ignored."""
    for key, flag, value in (("steps", "--steps", steps), ("fingerprint_every", "--fingerprint-every",
                                                         fingerprint_every)):
        if str((overrides or {}).get(key, value)) != str(value):
            raise ConfigError(f"--config.{key}={overrides[key]}: hetjax.repro {command} sets it to {value}; "
                              f"use {flag} instead")
    return {**(overrides or {}), "steps": str(steps), "fingerprint_every": str(fingerprint_every)}


def check(config: str, layouts: str, out: str | Path, overrides: dict | None = None, *, steps: int = 20,
          devices: int = 8, fingerprint_every: int = 10, rtol: float = compare_lib.LOSS_RTOL,
          norm_rtol: float = compare_lib.NORM_RTOL, timeout: float = 1800, echo=print) -> tuple[int, list]:
    """Runs every layout and compares each with the first. Returns (exit code, rows)."""
    compare_lib.check_tolerances(rtol, norm_rtol)  # before any run, not at the first comparison
    overrides = with_counts(overrides, steps, fingerprint_every, "check")
    cfg = config_lib.load(config, overrides)  # a bad key or value fails before any run
    lays = [layout(name, sizes, cfg, devices, config) for name, sizes in parse(layouts)]
    for lay in lays:  # every layout's config is checked before the first run
        lay_cfg = config_lib.load(lay.config or config, {**overrides, **lay.overrides})
        config_lib.validate(lay_cfg)
        if not lay_cfg.hetero.islands and lay.devices:  # one mesh: does the model split over it?
            _check_splits(lay_cfg, lay.devices)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out={str(out)!r} is a file; give a new directory")
    if out.exists() and any(p.name != ".jax_cache" for p in out.iterdir()):
        raise ConfigError(f"--out={str(out)!r} already holds runs; give a new directory (check never "
                          f"overwrites runs)")
    from hetjax.compile import backend
    platform = cfg.compile.platform if cfg.compile.platform != "auto" else backend.detect()[0]
    rows: list[Row] = []
    for i, lay in enumerate(lays):
        run_dir = out / f"{i}_{slug(lay.name)}"
        echo(f"[{i + 1}/{len(lays)}] {lay.name}: training {steps} steps in {run_dir}", flush=True)
        code = run(lay, config, overrides, run_dir, platform, timeout)
        if code != 0:
            tail = (run_dir / "train.log").read_text().splitlines()[-5:]
            echo(f"  failed (exit {code}):\n    " + "\n    ".join(tail), flush=True)
        compared = i > 0 and code == 0 and rows[0].ok
        rows.append(Row(lay.name, run_dir, code == 0,
                        compare_lib.compare(rows[0].run_dir, run_dir, rtol, norm_rtol) if compared else None))
    echo(table(rows, rtol, norm_rtol), flush=True)
    compared = {r.layout: r.run_dir for r in rows[1:] if r.report is not None}
    if compared:
        from hetjax import plot
        try:  # the verdict stands without its picture
            echo(f"loss gaps: {plot.loss_gaps(rows[0].run_dir, compared, out / 'loss_gaps.png', rtol, rows[0].layout)}", flush=True)
        except ConfigError as e:
            echo(f"no picture of the loss gaps: {e}", flush=True)
    if not all(r.ok for r in rows):
        return 1, rows
    return max(r.report.code for r in rows[1:]), rows


def table(rows, rtol: float, norm_rtol: float) -> str:
    """One line per layout, each against the first."""
    # The weights compared are those of the first params step both runs recorded: step 0
    # unless a run resumed or started from init_from at another step.
    inits = {row.report.init_step for row in rows if row.report is not None and row.report.init_step is not None}
    weights = f"step-{inits.pop()} weights" if len(inits) == 1 else "first common weights"
    head = ("layout", "data", weights, "1st loss diff", "max loss gap", "max norm drift", "verdict")
    lines = [head]
    for i, row in enumerate(rows):
        r = row.report
        if not row.ok:
            lines.append((row.layout, "-", "-", "-", "-", "-", "FAILED (see its train.log)"))
        elif i == 0:
            lines.append((row.layout, "-", "-", "-", "-", "-", "reference"))
        elif r is None:
            lines.append((row.layout, "-", "-", "-", "-", "-", "not compared (the reference failed)"))
        else:
            verdict = ("void" if r.void else "bit-identical" if r.identical
                       else "ok" if r.within else "OUT OF TOLERANCE")
            lines.append((row.layout, "same" if r.first_data_diff is None else f"differ@{r.first_data_diff}",
                          _weights(r, several=weights == "first common weights"),
                          "-" if r.first_loss_diff is None else str(r.first_loss_diff),
                          f"{r.max_loss_gap:.2e}", f"{r.max_norm_drift:.2e}", verdict))
    widths = [max(len(str(row[j])) for row in lines) for j in range(len(head))]
    text = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
    return "\n".join(text[:1] + ["-" * len(text[0])] + text[1:] +
                     [f"tolerances: loss rtol {rtol:g}, norm rtol {norm_rtol:g}"])


def _weights(r: compare_lib.Report, several: bool) -> str:
    """The weights cell: '-' where the runs share no params step (nothing was compared)."""
    if r.init_equal is None:
        return "-"
    word = "same" if r.init_equal else "DIFFER"
    return f"{word}@{r.init_step}" if several else word
