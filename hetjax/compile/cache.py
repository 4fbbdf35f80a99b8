"""jax's persistent compilation cache, one directory per platform and jax version.

A restarted run (or a second run of the same config) then loads its compiled
programs instead of compiling them. jax's own cache key already covers the
program, the flags and the versions; the directory split keeps caches of
different platforms and jax versions apart so each can be deleted on its own.
"""

from __future__ import annotations

from pathlib import Path

import jax


def directory(root: str, run_dir: str, platform: str) -> Path:
    """`root` (default: <parent of run_dir>/.jax_cache) / <platform>-jax<version>."""
    base = Path(root) if root else Path(run_dir).resolve().parent / ".jax_cache"
    return base / f"{platform}-jax{jax.__version__}"


def enable(path: Path) -> Path:
    """Caches every compiled program under `path`, however short its compile."""
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def count_hits():
    """A listener counting jax's cache hits and misses; returns the live counter dict."""
    from jax._src import monitoring
    counts = {"hits": 0, "misses": 0}
    names = {"/jax/compilation_cache/cache_hits": "hits", "/jax/compilation_cache/cache_misses": "misses"}

    def listener(event, **_):
        if event in names:
            counts[names[event]] += 1
    monitoring.register_event_listener(listener)
    return counts
