"""config.checkpoint, apart from hetjax/checkpoint.py so that reading a config imports no orbax."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hetjax.errors import ConfigError

CORRUPT_DIR = "corrupt"  # sibling of the checkpoint directory: damaged steps go here


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpoints in `dir` (default: run_dir/checkpoints); a restarted run resumes."""

    every: int = 100  # save every N steps (and at the end, and on SIGTERM); 0: only those
    keep: int = 3  # keep the newest K ...
    keep_every: int = 0  # ... plus every M-th step (0: none)
    async_save: bool = True  # write in a background thread while training goes on
    dir: str = ""


def validate_checkpoint(c: CheckpointConfig) -> None:
    """Raises ConfigError for a schedule that could never resume."""
    for key in ("every", "keep_every"):
        if getattr(c, key) < 0:
            raise ConfigError(f"config.checkpoint.{key}={getattr(c, key)}: use 0 (off) or a positive step count")
    if c.keep_every and c.every and c.keep_every % c.every:
        # only the steps both save and keep would be kept (every=10, keep_every=15: 30, 60, ...)
        raise ConfigError(f"config.checkpoint.keep_every={c.keep_every} is not a multiple of config.checkpoint.every="
                          f"{c.every}: steps that are not saved cannot be kept; use a multiple of {c.every} "
                          f"(e.g. {c.every * max(1, round(c.keep_every / c.every))})")
    if c.keep < 1:
        raise ConfigError(f"config.checkpoint.keep={c.keep}: keep at least 1 checkpoint, or resume is impossible")


def default_dir(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints")


def step_folders(directory: Path) -> list[int]:
    """The steps of `directory`'s step folders (named by their number), in order."""
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit())


def island_folders(directory: Path) -> list[str]:
    """The folders of `directory` that hold an island's checkpoint steps (an islands job's
    checkpoint directory has one per island), by name."""
    return sorted(p.name for p in directory.iterdir() if p.is_dir() and p.name != CORRUPT_DIR and not p.name.isdigit()
                  and step_folders(p))
