"""Backend profiles: the XLA flags, environment variables and jax options of one platform.

A profile is data, not code: `get(platform, deterministic)` returns a frozen
record, and `hetjax.compile.backend.apply` puts it in force before jax creates
its backends. Every flag here exists in jaxlib >= 0.10 (tests start a process
with each profile's XLA_FLAGS: XLA aborts on a flag it does not know). The GPU
flags are registered in every XLA build, so a CPU machine can check them too.

This module imports no jax, so config validation may use it before jax starts.
"""

from __future__ import annotations

import dataclasses

from hetjax.errors import ConfigError
from hetjax.errors import UnknownPlatform  # noqa: F401 - raised here, caught by callers

PLATFORMS = ("cpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class Profile:
    platform: str
    deterministic: bool
    xla_flags: tuple[str, ...]  # "--xla_...=value", appended to XLA_FLAGS
    env: tuple[tuple[str, str], ...]  # set unless the user already set them
    jax_config: tuple[tuple[str, object], ...]  # jax.config.update(name, value)

    @property
    def name(self) -> str:
        return self.platform + ("-deterministic" if self.deterministic else "")

    def flag_names(self) -> set[str]:
        return {f.split("=", 1)[0] for f in self.xla_flags}


# Shared by CUDA and ROCm (XLA's GPU compiler is one code base).
_GPU = (
    # Overlap collectives with compute: schedule by estimated latency, and pipeline
    # FSDP's per-layer all-gathers / reduce-scatters across scan iterations.
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_pipelined_all_gather=true",
    "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    "--xla_gpu_enable_while_loop_double_buffering=true",
    # Combine the many small per-parameter collectives into few large ones.
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_enable_highest_priority_async_stream=true",
)

# Fixed reduction order in kernels, and no kernels that cannot provide one; no
# timing-based autotuning, which can pick a different algorithm on each start.
_GPU_DETERMINISTIC = (
    "--xla_gpu_deterministic_ops=true",
    "--xla_gpu_exclude_nondeterministic_ops=true",
    "--xla_gpu_autotune_level=0",
)
# NCCL (and RCCL, which reads the same variables) picks its algorithm and protocol
# by message size and topology; fixing them fixes the order in which a reduction adds.
_COLLECTIVES_DETERMINISTIC = (("NCCL_ALGO", "Ring"), ("NCCL_PROTO", "Simple"))
# Random bits depend on the key only, not on how the array is sharded: the same
# values on any mesh (jax's default since 0.5; pinned here because repro needs it).
_JAX_DETERMINISTIC = (("jax_threefry_partitionable", True),)

_BASE = {
    "cuda": Profile(
        "cuda", False,
        xla_flags=_GPU,
        env=(
            # One hardware queue: kernels start in the order XLA's scheduler chose,
            # so a collective overlaps the compute it was scheduled against.
            ("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
            ("NCCL_NVLS_ENABLE", "0"),  # NVLink SHARP reserves memory per communicator
        ),
        jax_config=()),
    "rocm": Profile(
        "rocm", False,
        # Triton GEMMs on ROCm are slower than hipBLASLt for transformer shapes.
        xla_flags=_GPU + ("--xla_gpu_enable_triton_gemm=false", "--xla_gpu_enable_cublaslt=true"),
        env=(
            ("HSA_FORCE_FINE_GRAIN_PCIE", "1"),  # RCCL peer-to-peer over PCIe-attached GPUs
            ("GPU_MAX_HW_QUEUES", "2"),  # like CUDA_DEVICE_MAX_CONNECTIONS: keep launch order
            ("NCCL_MIN_NCHANNELS", "112"),  # RCCL on MI300X saturates xGMI with many channels
        ),
        jax_config=()),
    "cpu": Profile(
        "cpu", False,
        xla_flags=(),
        env=(),
        # Cross-process collectives on CPU (several jax.distributed processes).
        jax_config=(("jax_cpu_collectives_implementation", "gloo"),)),
}

_DETERMINISTIC_ADDITIONS = {
    "cuda": (_GPU_DETERMINISTIC, _COLLECTIVES_DETERMINISTIC),
    "rocm": (_GPU_DETERMINISTIC, _COLLECTIVES_DETERMINISTIC),
    # XLA:CPU kernels reduce in a fixed order already and gloo's ring reduces in rank
    # order; what can still differ is value-changing math rewrites.
    "cpu": (("--xla_cpu_enable_fast_math=false", "--xla_cpu_enable_fast_min_max=false"), ()),
}


def check_platform(platform: str, field: str = "platform") -> str:
    """Returns `platform` if it has a profile, else raises naming `field`."""
    if platform not in PLATFORMS:
        import difflib
        close = difflib.get_close_matches(platform, PLATFORMS, n=1)
        hint = (" ('gpu' is ambiguous: choose cuda or rocm)" if platform == "gpu" else
                f" (did you mean {close[0]!r}?)" if close else "")
        raise UnknownPlatform(
            f"{field}={platform!r} is not a platform with a profile; choose one of "
            f"{', '.join(PLATFORMS)}{hint}")
    return platform


def check_platforms(platforms, field: str = "--platforms") -> tuple[str, ...]:
    """check_platform for each, refusing one named twice: likely a typo for one left out
    (cuda,cuda for cuda,rocm), which dropping the repeat would hide."""
    platforms = tuple(check_platform(p, field) for p in platforms)
    if twice := sorted({p for p in platforms if platforms.count(p) > 1}):
        raise ConfigError(f"{field}={','.join(platforms)} names {', '.join(twice)} twice; give each "
                              f"platform once (e.g. {field}={','.join(dict.fromkeys(platforms))})")
    return platforms


def get(platform: str, deterministic: bool = False) -> Profile:
    """The profile of `platform` (cpu, cuda or rocm), or its deterministic variant."""
    base = _BASE[check_platform(platform)]
    if not deterministic:
        return base
    flags, env = _DETERMINISTIC_ADDITIONS[platform]
    return dataclasses.replace(base, deterministic=True, xla_flags=base.xla_flags + flags,
                               env=base.env + env, jax_config=base.jax_config + _JAX_DETERMINISTIC)


def all_profiles() -> list[Profile]:
    return [get(p, d) for p in PLATFORMS for d in (False, True)]
