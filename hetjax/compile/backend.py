"""Puts a backend profile in force before jax creates its backends.

XLA reads XLA_FLAGS, and NCCL/RCCL read their variables, once: when jax first
creates a backend (the first `jax.devices()`, array or compile). Importing jax is
fine; touching a device first is not, and `apply` refuses if that already happened
with other flags. Order in a program:

    profile, source = backend.resolve(cfg.compile)   # detection touches no device
    backend.apply(profile)                           # env + jax config
    ... jax.devices(), compile, train ...

Islands (#8) call `apply(profiles.get(island.platform, deterministic))` in each
island's own process; repro (#9) sets `config.compile.deterministic=True`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import pkgutil
import re

from hetjax.compile import profiles
from hetjax.compile.config import CompileConfig
from hetjax.errors import ConfigError
from hetjax.errors import BackendStarted  # noqa: F401 - raised here, caught by callers


# pip names of jax's PJRT plugins, e.g. jax-cuda12-plugin, jax-cuda13-pjrt, jax-rocm7-plugin,
# and the modules they install under the jax_plugins namespace (xla_cuda12, xla_rocm7).
_PLUGIN_DIST = re.compile(r"^jax[-_](cuda|rocm)\d*[-_](plugin|pjrt)$")
_PLUGIN_MODULE = re.compile(r"^xla_(cuda|rocm)\d*$")


def installed_plugins() -> dict[str, str]:
    """platform -> what shows it is installed, found without starting any backend."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        m = _PLUGIN_DIST.match(name)
        if m:
            found.setdefault(m.group(1), f"{name} is installed")
    if importlib.util.find_spec("jax_plugins") is not None:
        import jax_plugins  # a namespace package: importing it loads no plugin
        for module in pkgutil.iter_modules(jax_plugins.__path__):
            m = _PLUGIN_MODULE.match(module.name)
            if m:
                found.setdefault(m.group(1), f"jax_plugins.{module.name} is installed")
    return found


# Device nodes a platform's driver creates; their absence means no such GPU here.
# /dev/dxg: WSL2, where CUDA reaches the GPU through DirectX and no /dev/nvidia* exists.
_DEVICE_NODES = {"cuda": ("/dev/nvidiactl", "/dev/nvidia0", "/dev/dxg"), "rocm": ("/dev/kfd",)}


def unavailable(platform: str, plugins: dict[str, str] | None = None) -> str | None:
    """Why `platform` cannot start on this machine (no jax plugin, no device node), or
    None if it may; looks at files only, starts no backend."""
    if platform == "cpu":
        return None
    plugins = installed_plugins() if plugins is None else plugins
    if platform not in plugins:
        return f"no jax plugin for {platform} is installed"
    if not any(os.path.exists(node) for node in _DEVICE_NODES.get(platform, ())):
        return f"no {platform} device ({' or '.join(_DEVICE_NODES[platform])}) exists"
    return None


def detect(environ=None) -> tuple[str, str]:
    """(platform, why) from JAX_PLATFORMS or the installed jax plugins; cpu otherwise."""
    environ = os.environ if environ is None else environ
    requested = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if requested and requested[0] in profiles.PLATFORMS:
        return requested[0], f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}"
    plugins = installed_plugins()
    if len(plugins) > 1:
        raise ConfigError(
            f"both a CUDA and a ROCm jax plugin are installed ({'; '.join(plugins.values())}), "
            f"so the platform cannot be detected; set config.compile.platform to cuda or rocm")
    if plugins:
        (platform, why), = plugins.items()
        # jax falls back to its CPU then: the GPU profile's flags and cache would go with it.
        if (missing := unavailable(platform, plugins)) is not None:
            return "cpu", f"{why}, but {missing}"
        return platform, why
    return "cpu", "no GPU plugin for jax is installed"


def resolve(compile_cfg: CompileConfig, environ=None) -> tuple[profiles.Profile, str]:
    """The profile the config asks for (or detection finds), and why it was chosen."""
    if compile_cfg.platform == "auto":
        platform, why = detect(environ)
        why = f"detected: {why}"
    else:
        platform = profiles.check_platform(compile_cfg.platform, "config.compile.platform")
        why = "config.compile.platform"
    return profiles.get(platform, compile_cfg.deterministic), why


@dataclasses.dataclass(frozen=True)
class Applied:
    """What `apply` put in force, and what the user's environment kept."""

    profile: profiles.Profile
    why: str
    kept: tuple[str, ...]  # flags/variables the user had set differently: theirs win
    xla_flags: str = ""  # XLA_FLAGS as XLA will read it: the user's and the profile's

    def describe(self) -> str:
        p = self.profile
        parts = [f"backend profile {p.name} ({self.why})", "XLA_FLAGS: " + (self.xla_flags or "(none)")]
        if p.env:
            parts.append("env: " + " ".join(f"{k}={v}" for k, v in p.env))
        if p.jax_config:
            parts.append("jax: " + " ".join(f"{k}={v}" for k, v in p.jax_config))
        if self.kept:
            parts.append("kept from your environment: " + " ".join(self.kept))
        return "; ".join(parts)


def _flag_dict(text: str) -> dict[str, str]:
    return dict((f.split("=", 1) + [""])[:2] for f in text.split())


def backends_started() -> bool:
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()


def apply(profile: profiles.Profile, why: str = "", environ=None) -> Applied:
    """Appends the profile's XLA flags to XLA_FLAGS, sets its env vars and jax options.

    A flag or variable the user already set keeps the user's value. Raises
    BackendStarted if jax's backends exist and the flags are not already in force.
    """
    import jax
    environ = os.environ if environ is None else environ
    current = _flag_dict(environ.get("XLA_FLAGS", ""))
    kept, add = [], []
    for flag in profile.xla_flags:
        name, value = flag.split("=", 1)
        if name not in current:
            add.append(flag)
        elif current[name] != value:
            kept.append(f"{name}={current[name]}")
    if add and backends_started():
        raise BackendStarted(
            f"jax's backends were created before the {profile.name} profile was applied, so its "
            f"XLA flags ({' '.join(add)}) cannot take effect; apply the profile before anything "
            f"calls jax.devices() or runs a jax computation")
    if add:
        environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", "").strip(), *add]).strip()
    for key, value in profile.env:
        if key in environ and environ[key] != value:
            kept.append(f"{key}={environ[key]}")
        environ.setdefault(key, value)
    for name, value in profile.jax_config:
        jax.config.update(name, value)
    return Applied(profile, why, tuple(kept), environ.get("XLA_FLAGS", "").strip())


def setup(compile_cfg: CompileConfig, environ=None) -> Applied:
    """resolve + apply: the one call a program makes before it touches a device."""
    profile, why = resolve(compile_cfg, environ)
    return apply(profile, why, environ)


_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def cpu_device_count(environ=None) -> int | None:
    """The virtual CPU device count that XLA_FLAGS asks for (None: XLA's default, one)."""
    value = _flag_dict((os.environ if environ is None else environ).get("XLA_FLAGS", "")).get(_DEVICE_COUNT, "")
    return int(value) if value.isdigit() else None


def with_cpu_device_count(xla_flags: str, count: int) -> str:
    """XLA_FLAGS with the virtual CPU device count set to `count` (any earlier count dropped)."""
    flags = {k: v for k, v in _flag_dict(xla_flags).items() if k != _DEVICE_COUNT}
    flags[_DEVICE_COUNT] = str(count)
    return " ".join(f"{k}={v}" if v else k for k, v in flags.items())


def virtual_cpu_devices(count: int, environ=None) -> None:
    """Makes jax start with `count` virtual CPU devices (for lowering without hardware)."""
    environ = os.environ if environ is None else environ
    if backends_started():
        import jax
        if jax.device_count() != count or jax.default_backend() != "cpu":
            raise BackendStarted(
                f"need {count} virtual CPU devices, but jax already started with "
                f"{jax.device_count()} {jax.default_backend()} device(s); run in a fresh process")
        return
    environ["XLA_FLAGS"] = with_cpu_device_count(environ.get("XLA_FLAGS", ""), count)
    environ["JAX_PLATFORMS"] = "cpu"


def start(cfg, startable: bool = True) -> str:
    """The profile and the compilation cache for a run of `cfg`; returns the start-up line.
    startable=False: an island's process, whose platform its island's check names after
    jax starts (hetero.runtime.check_platform), not config.compile.platform."""
    from hetjax.compile import cache
    check_attention(cfg.model, resolve(cfg.compile)[0].platform)  # before XLA's flags are set
    applied = setup(cfg.compile)
    check_started_attention(cfg.model, applied.profile.name)
    if startable:
        check_startable(cfg.compile, applied.profile.platform)
    line = applied.describe()
    if cfg.compile.cache:
        path = cache.enable(cache.directory(cfg.compile.cache_dir, cfg.run_dir, applied.profile.platform))
        line += f"; compilation cache: {path}"
    return line


def check_startable(compile_cfg: CompileConfig, platform: str, environ=None) -> None:
    """Refuses config.compile.platform where jax would start on another platform, there to
    run under this profile's flags and cache without a word.

    From files and variables, starting no backend: `start` comes before
    jax.distributed.initialize, which must precede any backend. What picks a platform on
    purpose makes the two agree: CPU stand-ins (--stand_in, HETJAX_STAND_IN) set
    platform=cpu with JAX_PLATFORMS=cpu, island processes their island's platform with its
    JAX_PLATFORMS; export and the planner lower on CPU devices and never call `start`.
    platform=cpu with JAX_PLATFORMS unset passes: virtual islands set it after `start`."""
    if compile_cfg.platform == "auto":  # detection read JAX_PLATFORMS and the plugins already
        return
    environ = os.environ if environ is None else environ
    first = next((p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()), "")
    named = {"gpu": ("cuda", "rocm")}.get(first, (first,))
    if first and platform not in named:
        why, where = f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}", first
    else:  # JAX_PLATFORMS=gpu starts whichever GPU plugin is here: a ROCm node took platform=cuda
        why, where = (None if first and first != "gpu" else unavailable(platform)), "another platform"
    if why:
        raise ConfigError(f"config.compile.platform={platform!r}, but {why}, so jax would start on {where} "
                          f"under the {platform} profile's settings; run where {platform} starts, or set "
                          f"--config.compile.platform=auto (or the platform jax starts on)")


def check_started_attention(model, profile: str) -> None:
    """check_attention against the platform jax did start on: a CUDA profile on a machine
    without a CUDA GPU runs on CPU, where cuDNN fails inside tracing."""
    if model.attention_impl != "cudnn":
        return
    import jax  # started now, with the profile's settings
    if (started := jax.export.default_export_platform()) != "cuda":  # cuda or rocm where default_backend() is gpu
        raise ConfigError(f"config.model.attention_impl='cudnn' runs on CUDA GPUs only, and jax started on "
                          f"{started} here (the {profile} profile sets flags, not the device); run it on a "
                          f"CUDA GPU, or use attention_impl='xla'")


def check_attention(model, platform: str) -> None:
    """cuDNN's fused attention runs on CUDA GPUs only, in bf16 or fp16: refused before
    anything compiles (jax would fail inside tracing)."""
    if model.attention_impl != "cudnn":
        return
    if platform != "cuda":
        raise ConfigError(f"config.model.attention_impl='cudnn' runs on CUDA GPUs only, and this run is on "
                          f"{platform}; use 'xla' (jax's 'auto' is XLA too)")
    if model.dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"config.model.attention_impl='cudnn' computes in bfloat16 or float16, and "
                          f"config.model.dtype={model.dtype!r}; set --config.model.dtype=bfloat16, or use "
                          f"attention_impl='xla'")
    if model.head_dim % 8 or model.head_dim > 256:  # jax's own check comes inside tracing
        raise ConfigError(f"config.model.attention_impl='cudnn' takes heads of a multiple of 8 up to 256 "
                          f"dimensions, and config.model.head_dim={model.head_dim}; use attention_impl='xla'")


# Islands on CPU, and the processes of a one-mesh world on CPU, compile every program
# afresh. Loaded from jax's persistent cache, such programs (several in flight, each with
# collectives) have aborted in XLA:CPU's collective rendezvous on jax 0.10.2 ("2 threads
# expected, 1 arrived"), the `direct` stall an earlier bench saw; compiled afresh they
# never did. Their compiles take seconds.
def start_afresh_on_cpu(cfg, cpu: bool, who: str = "CPU islands", startable: bool = True) -> str:
    """start(cfg, startable), without the persistent compilation cache when `cpu` (see above)."""
    if cpu and cfg.compile.cache:
        cfg = dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, cache=False))
        return start(cfg, startable) + f"; compilation cache: off ({who} compile afresh)"
    return start(cfg, startable)