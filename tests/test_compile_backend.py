"""Backend profiles, platform detection, and the persistent compilation cache."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetjax.compile import backend, profiles
from hetjax.config import CompileConfig, Config, ConfigError, validate

ROOT = Path(__file__).resolve().parent.parent


def python(code: str, *args: str, **env):
    """Starts a fresh interpreter (jax not yet started) with `env` added."""
    base = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    base.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), **env)
    return subprocess.Popen([sys.executable, "-c", code, *args], env=base, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# Imports jax first (as hetjax.train does at module top), then applies the profile
# and starts the CPU backend, which parses XLA_FLAGS and aborts on an unknown flag.
APPLY = """
import os, sys, jax
from hetjax.compile import backend, profiles
backend.apply(profiles.get(sys.argv[-2], sys.argv[-1] == "1"))
assert not backend.backends_started()
jax.devices()
print(os.environ.get("XLA_FLAGS", ""))
"""


def test_every_profile_parses_and_xla_rejects_an_unknown_flag():
    procs = [(p, python(APPLY, p.platform, str(int(p.deterministic)))) for p in profiles.all_profiles()]
    # The control: the same start-up with one made-up flag must fail, or the check proves nothing.
    bogus = python("import jax; jax.devices()", XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true "
                                                        "--xla_gpu_no_such_flag=true")
    for profile, proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{profile.name}: {err[-2000:]}"
        assert set(out.split()) == set(profile.xla_flags)
    _, err = bogus.communicate(timeout=120)
    assert bogus.returncode != 0 and "Unknown flag" in err and "xla_gpu_no_such_flag" in err


def test_flags_applied_after_import_jax_take_effect():
    # hetjax.train imports jax at module top; flags set afterwards must still reach XLA.
    code = """
import hetjax.train, jax, dataclasses
from hetjax.compile import backend, profiles
p = dataclasses.replace(profiles.get("cpu"), xla_flags=("--xla_force_host_platform_device_count=3",))
backend.apply(p)
print(jax.device_count())
"""
    out, err = python(code).communicate(timeout=120)
    assert out.split() == ["3"], err[-2000:]


def test_deterministic_variants_add_the_deterministic_settings():
    for platform in ("cuda", "rocm"):
        base, det = profiles.get(platform), profiles.get(platform, deterministic=True)
        assert {"--xla_gpu_deterministic_ops=true",
                "--xla_gpu_exclude_nondeterministic_ops=true"} <= set(det.xla_flags)
        assert not {"--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops"} & base.flag_names()
        assert dict(det.env)["NCCL_ALGO"] == "Ring" and dict(det.env)["NCCL_PROTO"] == "Simple"
        assert "NCCL_ALGO" not in dict(base.env)
    for platform in profiles.PLATFORMS:
        base, det = profiles.get(platform), profiles.get(platform, deterministic=True)
        assert set(base.xla_flags) < set(det.xla_flags) and set(base.env) <= set(det.env)
        assert ("jax_threefry_partitionable", True) in det.jax_config
        assert det.name == f"{platform}-deterministic"
    assert ("jax_cpu_collectives_implementation", "gloo") in profiles.get("cpu").jax_config


def test_unknown_platform_names_the_field():
    with pytest.raises(ConfigError, match=r"config\.compile\.platform='tpu'.*cpu, cuda, rocm"):
        validate(dataclasses.replace(Config(), compile=CompileConfig(platform="tpu")))
    with pytest.raises(profiles.UnknownPlatform, match="ambiguous"):
        profiles.get("gpu")
    with pytest.raises(ConfigError, match="did you mean 'cuda'"):
        backend.resolve(CompileConfig(platform="cdua"))


def test_detection(monkeypatch):
    assert backend._PLUGIN_DIST.match("jax-cuda12-plugin") and backend._PLUGIN_DIST.match("jax_rocm7_pjrt")
    assert not backend._PLUGIN_DIST.match("jaxlib") and not backend._PLUGIN_DIST.match("jax")
    assert backend.detect({"JAX_PLATFORMS": "rocm"})[0] == "rocm"
    assert backend.detect({})[0] == "cpu"  # this machine has no GPU plugin
    monkeypatch.setattr(backend, "installed_plugins", lambda: {"cuda": "jax-cuda12-plugin is installed"})
    # A plugin installed where no GPU is (a CUDA image on a CPU node): jax runs on its CPU,
    # and so does the profile. It said cuda, and put the CUDA flags and cache on a CPU run.
    assert backend.detect({}) == ("cpu", "jax-cuda12-plugin is installed, but no cuda device "
                                         "(/dev/nvidiactl or /dev/nvidia0 or /dev/dxg) exists")
    monkeypatch.setitem(backend._DEVICE_NODES, "cuda", ("/dev/null",))  # a node that exists: a GPU here
    assert backend.detect({}) == ("cuda", "jax-cuda12-plugin is installed")
    assert backend.detect({"JAX_PLATFORMS": "cpu"})[0] == "cpu"
    profile, why = backend.resolve(CompileConfig(deterministic=True), {})
    assert profile == profiles.get("cuda", True) and "detected" in why
    monkeypatch.setattr(backend, "installed_plugins", lambda: {"cuda": "a", "rocm": "b"})
    with pytest.raises(ConfigError, match="config.compile.platform"):
        backend.detect({})


def test_apply_keeps_user_settings_and_refuses_once_jax_started():
    # conftest started jax already: a profile with new XLA flags can no longer apply.
    with pytest.raises(backend.BackendStarted, match="before anything calls jax.devices"):
        backend.apply(profiles.get("cuda"), environ={})
    env = {"XLA_FLAGS": "--xla_gpu_autotune_level=4 --xla_force_host_platform_device_count=8",
           "NCCL_ALGO": "Tree"}
    cuda = profiles.get("cuda", deterministic=True)
    env["XLA_FLAGS"] += " " + " ".join(f for f in cuda.xla_flags if "autotune" not in f)
    applied = backend.apply(cuda, environ=env)
    assert "--xla_gpu_autotune_level=4" in applied.kept and "NCCL_ALGO=Tree" in applied.kept
    assert env["NCCL_ALGO"] == "Tree" and env["NCCL_PROTO"] == "Simple"
    line = applied.describe()
    assert "cuda-deterministic" in line and "--xla_gpu_deterministic_ops=true" in line
    # the first line of a run shows every flag in force, the user's own included
    assert "--xla_force_host_platform_device_count=8" in line and "--xla_gpu_autotune_level=4" in line


CACHED_START = """
import json, sys
from hetjax.compile import cache
counts = cache.count_hits()
from hetjax import train
assert train.main(["--config", "tiny.py", "--compile_only", "--config.run_dir=" + sys.argv[-1],
                   "--config.model.num_layers=1"]) == 0
print(json.dumps(counts))
"""


def test_second_start_hits_the_compilation_cache(tmp_path):
    runs = []
    for _ in range(2):
        proc = python(CACHED_START, str(tmp_path / "run"))
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-2000:]
        assert "backend profile cpu (detected" in out and "compilation cache:" in out
        runs.append(json.loads(out.splitlines()[-1]))
    first, second = runs
    assert first["hits"] == 0 and first["misses"] >= 1  # the train step, compiled and stored
    assert second["hits"] == first["misses"] and second["misses"] == 0
    key = f"cpu-jax{__import__('jax').__version__}"
    assert list((tmp_path / ".jax_cache" / key).iterdir())


def test_cudnn_attention_is_refused_where_jax_has_no_cuda_device_whatever_the_profile(tmp_path, capsys, monkeypatch):
    """With config.compile.platform=cuda on a machine without a GPU, jax starts on CPU and
    used to fail inside tracing ("cuDNN is not detected", a traceback); the plan and the
    export lower on CPU devices and failed the same way."""
    run_dir = tmp_path / "run"
    p = python("from hetjax import train; import sys; sys.exit(train.cli())", "--config", "tiny",
               "--config.compile.platform=cuda", "--config.model.attention_impl=cudnn",
               "--config.model.dtype=bfloat16", f"--config.run_dir={run_dir}", "--config.steps=1")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 2, out + err
    assert "attention_impl='cudnn' runs on CUDA GPUs only, and jax started on cpu here" in err and "Traceback" not in err
    assert not run_dir.exists()
    from hetjax.compile import cli
    from hetjax.compile.__main__ import main as compile_main
    from hetjax.plan import main as plan_main
    for main, extra in ((compile_main, ["--platforms", "cuda"]), (plan_main, [])):
        assert cli.run(main, ["--config", "tiny", "--devices", "8", "--out", str(tmp_path / "out"), *extra,
                              "--config.model.attention_impl=cudnn", "--config.model.dtype=bfloat16"]) == 2
        assert "use --config.model.attention_impl=xla here" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # On a CUDA GPU jax's default_backend() is "gpu": the check asks which platform, and passes.
    model = Config().model.__class__(attention_impl="cudnn", dtype="bfloat16")
    import jax
    for started, refused in (("cuda", False), ("rocm", True), ("cpu", True)):
        monkeypatch.setattr(jax.export, "default_export_platform", lambda started=started: started)
        if refused:
            with pytest.raises(ConfigError, match=f"jax started on {started} here"):
                backend.check_started_attention(model, "cuda")
        else:
            backend.check_started_attention(model, "cuda")


def test_cudnn_attention_refuses_heads_it_cannot_take_before_anything_compiles():
    """head_dim=12 passed the checks and ended on the GPU in jax's NotImplementedError, from
    inside tracing (seen on an H200: cuDNN takes multiples of 8 up to 256)."""
    model = Config().model.__class__
    for head_dim in (12, 264):
        with pytest.raises(ConfigError, match=f"config.model.head_dim={head_dim}; use attention_impl='xla'"):
            backend.check_attention(model(attention_impl="cudnn", dtype="bfloat16", head_dim=head_dim), "cuda")
    for head_dim in (16, 64, 256):
        backend.check_attention(model(attention_impl="cudnn", dtype="bfloat16", head_dim=head_dim), "cuda")


def test_a_platform_jax_would_not_start_on_is_refused(monkeypatch):
    """config.compile.platform=rocm on a CPU machine printed the ROCm profile and its flags,
    then ran on CPU under them. Told from files and JAX_PLATFORMS: `start` precedes
    jax.distributed.initialize, so it may not start a backend to ask."""
    rocm, cuda, cpu = (CompileConfig(platform=p) for p in ("rocm", "cuda", "cpu"))
    monkeypatch.setattr(backend, "installed_plugins", lambda: {"cuda": "jax-cuda12-plugin is installed"})
    monkeypatch.setattr(backend, "_DEVICE_NODES", {"cuda": ("/nonexistent/nvidia0",), "rocm": ("/dev/kfd",)})
    with pytest.raises(ConfigError, match=r"config.compile.platform='rocm', but no jax plugin for rocm is installed, "
                                          r"so jax would start on another platform under the rocm profile"):
        backend.check_startable(rocm, "rocm", {})
    with pytest.raises(ConfigError, match=r"'cuda', but no cuda device \(/nonexistent/nvidia0\) exists"):
        backend.check_startable(cuda, "cuda", {})
    with pytest.raises(ConfigError, match=r"'rocm', but JAX_PLATFORMS=cpu, so jax would start on cpu .*"
                                          r"--config.compile.platform=auto"):
        backend.check_startable(rocm, "rocm", {"JAX_PLATFORMS": "cpu"})
    with pytest.raises(ConfigError, match=r"'cpu', but JAX_PLATFORMS=gpu"):
        backend.check_startable(cpu, "cpu", {"JAX_PLATFORMS": "gpu"})
    # JAX_PLATFORMS=gpu starts the GPU plugin that is installed (here CUDA's): it passed
    # platform=rocm, to run under the ROCm profile and its cache on a CUDA GPU.
    with pytest.raises(ConfigError, match=r"'rocm', but no jax plugin for rocm is installed"):
        backend.check_startable(rocm, "rocm", {"JAX_PLATFORMS": "gpu,cpu"})
    # What sets them apart on purpose agrees, or cannot be told: CPU stand-ins (cpu with
    # JAX_PLATFORMS=cpu), virtual islands (cpu; JAX_PLATFORMS comes after `start`), island
    # processes (their platform in JAX_PLATFORMS: jax itself refuses one it lacks), auto.
    for compile_cfg, platform, environ in ((cpu, "cpu", {"JAX_PLATFORMS": "cpu"}), (cpu, "cpu", {}),
                                           (rocm, "rocm", {"JAX_PLATFORMS": "rocm"}), (CompileConfig(), "rocm", {})):
        backend.check_startable(compile_cfg, platform, environ)
    monkeypatch.setattr(backend, "_DEVICE_NODES", {"cuda": ("/",), "rocm": ("/dev/kfd",)})  # a CUDA GPU here
    backend.check_startable(cuda, "cuda", {"JAX_PLATFORMS": "gpu"})
    # `start` checks it once the profile is resolved (after a cuDNN refusal, which names more).
    monkeypatch.setattr(backend, "setup", lambda c: backend.Applied(profiles.get(c.platform), "", ()))
    with pytest.raises(ConfigError, match=r"config.compile.platform='rocm', but"):
        backend.start(dataclasses.replace(Config(), compile=dataclasses.replace(rocm, cache=False)))
