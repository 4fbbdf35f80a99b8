"""config.compile: the backend profile put in force before jax starts, and the cache."""

from __future__ import annotations

import dataclasses

from hetjax.compile import profiles  # no jax import: safe before the backend starts


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """Which backend profile (XLA flags, env vars) is set before jax starts, and the cache."""

    platform: str = "auto"  # auto (detect the installed plugin) | cpu | cuda | rocm
    deterministic: bool = False  # the profile's deterministic variant (repeatable reductions)
    cache: bool = True  # jax's persistent compilation cache
    cache_dir: str = ""  # "": <parent of run_dir>/.jax_cache/<platform>-jax<version>


def validate_compile(c: CompileConfig) -> None:
    """Raises ConfigError for a platform no profile exists for."""
    if c.platform != "auto":
        profiles.check_platform(c.platform, "config.compile.platform")
