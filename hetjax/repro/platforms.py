"""The same config on two platforms of one machine (CPU and its GPU), from one set of
initial weights, compared:

    python -m hetjax.repro platforms --config tiny --steps 20 --out runs/cpu_vs_gpu

Initialisers may round differently on another platform, so neither run initialises:
a separate CPU process saves the step-0 parameters once (`python -m hetjax.repro init`)
and both runs start from them with config.init_from, as MosaicML's MI250/A100 runs
started from one checkpoint. Each run uses one device, the deterministic profile, and
fp32 matmuls at full precision (JAX_DEFAULT_MATMUL_PRECISION=highest: a GPU would
otherwise multiply fp32 in TF32, which is a precision choice, not a vendor difference).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hetjax import config as config_lib
from hetjax.errors import ConfigError
from hetjax.repro import check as check_lib
from hetjax.repro import compare as compare_lib

# Another platform's kernels order the sums inside every matmul, softmax and norm
# differently (not only the cross-device reductions). Measured on an H200 against its
# host CPU (tiny, 20 steps, fp32 at full precision, deterministic profiles; README "On a
# GPU"): losses differ by at most 5.5e-7 and tensor norms by 6.9e-8, a few fp32 roundings
# (2^-23 = 1.2e-7), as large as another layout's gaps on one platform (up to 4.3e-7). So
# a platform is held to the layouts' tolerance (compare.LOSS_RTOL, NORM_RTOL: 1e-4, a
# margin of about 200), not a wider one; a gap above it is a real difference.
PLATFORM_RTOL = compare_lib.LOSS_RTOL
PLATFORM_NORM_RTOL = compare_lib.NORM_RTOL
VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}


def parse_platforms(text: str) -> list[str | None]:
    """--platforms 'cpu,gpu' -> ['cpu', None] (None: this machine's GPU). A name without a
    backend profile is refused here: found only when its run starts, it cost the initial
    weights and the whole first run first."""
    from hetjax.compile import profiles
    names = [p.strip() for p in text.split(",")]
    if len(names) != 2:
        raise ConfigError(f"--platforms={text!r}: name two, e.g. cpu,gpu")
    for name in names:
        if name != "gpu" and name not in profiles.PLATFORMS:
            raise ConfigError(f"--platforms={text!r}: {name!r} is not a platform with a profile; name two of "
                              f"{', '.join(profiles.PLATFORMS)}, gpu (this machine's), e.g. cpu,gpu")
    return [None if name == "gpu" else name for name in names]


def save_initial(config: str, overrides: dict, out: str | Path) -> Path:
    """Initialises `config`'s parameters on this process's devices (one mesh axis over
    all of them, no pipeline) and saves them as checkpoint 0 in out/checkpoints."""
    from hetjax import checkpoint, data, program
    from hetjax.compile import backend
    from hetjax.mesh import make_mesh
    cfg = config_lib.load(config, {**overrides, "mesh.pipeline": "1", "mesh.data": "1", "mesh.tensor": "1",
                                   "mesh.fsdp": "-1", "run_dir": str(out)})
    config_lib.validate(cfg)
    backend.start(cfg)
    mesh = make_mesh(cfg.mesh)
    state = program.build(cfg, mesh).init_state()
    ckpt = checkpoint.Manager(checkpoint.default_dir(cfg), cfg.checkpoint)
    ckpt.save(0, state, {"step": 0, "fingerprint": data.build(cfg).fingerprint}, config_lib.to_dict(cfg))
    ckpt.wait()
    ckpt.close()
    return Path(out)


def compare_platforms(config: str, overrides: dict, out: str | Path, platforms=("cpu", None), *,
                      steps: int = 20, fingerprint_every: int = 10, rtol: float = PLATFORM_RTOL,
                      norm_rtol: float = PLATFORM_NORM_RTOL, timeout: float = 1800,
                      echo=print) -> int:
    """Trains `config` on each platform (None: this machine's GPU) from one saved set of
    initial weights, and compares the second run with the first. Returns the exit code."""
    from hetjax.compile import backend, profiles
    compare_lib.check_tolerances(rtol, norm_rtol)  # before any run, not at the comparison
    for p in platforms:  # a caller other than the command line is held to the same names
        if p is not None:
            profiles.check_platform(p, "platforms")
    gpus = sorted(backend.installed_plugins())
    platforms = [p or (gpus[0] if gpus else None) for p in platforms]
    if None in platforms:
        raise ConfigError("no GPU plugin for jax is installed here (jax-cuda*-plugin or jax-rocm*-plugin), "
                          "so there is no GPU run to compare; run this on a machine with a GPU")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out={str(out)!r} is not empty; give a new directory")
    overrides = check_lib.with_counts(overrides, steps, fingerprint_every, "platforms")
    config_lib.validate(config_lib.load(config, overrides))  # a bad key fails before any run
    env = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    init = out / "init"
    echo(f"saving the initial weights (CPU) in {init}", flush=True)
    proc = subprocess.run([sys.executable, "-m", "hetjax.repro", "init", "--config", config, "--out", str(init),
                           *[f"--config.{k}={v}" for k, v in overrides.items()]],
                          env={**check_lib.cpu_env(1), **env, "PYTHONPATH": check_lib.python_path()},
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"saving the initial weights failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    runs = []
    for i, platform in enumerate(platforms):
        mesh = {f"mesh.{a}": "1" for a in config_lib.MESH_AXES}
        lay = check_lib.Layout(platform, {**mesh, "compile.platform": platform, "init_from": str(init)}, 1)
        run_dir = out / f"{i}_{platform}"
        echo(f"training {steps} steps on {platform} in {run_dir}", flush=True)
        extra = {**env, **({VISIBLE[platform]: os.environ.get(VISIBLE[platform], "0").split(",")[0]}
                           if platform in VISIBLE else {})}
        code = check_lib.run(lay, config, overrides, run_dir, platform, timeout, env=extra)
        if code:
            echo(f"  failed (exit {code}); see {run_dir / 'train.log'}", flush=True)
            return 1
        runs.append(run_dir)
    report = compare_lib.compare(runs[0], runs[1], rtol, norm_rtol)
    echo(compare_lib.describe(report), flush=True)
    compare_lib.plot_or_say_why_not(runs[0], runs[1], out / "compare.png", echo)
    return report.code
