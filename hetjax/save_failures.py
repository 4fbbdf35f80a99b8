"""Why a checkpoint save failed, in one line: the first cause orbax's writing threads
logged (orbax often raises only a generic error), the checkpoint kept, a hint, and
where orbax's own reports of it went (hetjax/orbax_noise.py).
"""

from __future__ import annotations

from pathlib import Path

from hetjax.errors import CheckpointError
from hetjax.orbax_noise import Reports


def error(directory: Path, step, raised: BaseException, causes: Reports) -> CheckpointError:
    """The error to raise for the failed save of `step`. Never raises itself: it only
    lists step directories."""
    cause = _root_cause(raised) or causes.first() or f"{type(raised).__name__}: {raised}"
    causes.clear()
    try:
        good = [int(p.name) for p in directory.iterdir() if p.name.isdigit() and int(p.name) != step]
    except OSError:
        good = []
    kept = f"the previous checkpoint (step {max(good)}) is untouched" if good else "no earlier checkpoint exists"
    more = f" (orbax's reports: {causes.path})" if causes.path.is_file() else ""
    return CheckpointError(f"saving checkpoint step {step} to {directory} failed: {cause}; {kept}. "
                           f"{_hint(cause)}{more}")


def _root_cause(error: BaseException) -> str | None:
    """The innermost OSError in `error`'s chain (orbax wraps it in its own errors)."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            found = error
        error = error.__cause__ or error.__context__
    return None if found is None else f"{type(found).__name__}: {found}"


def _hint(cause: str) -> str:
    low = cause.lower()
    if any(k in low for k in ("no space", "file too large", "quota", "errno 28", "errno 27")):
        return ("Free disk space (or raise the file size limit, `ulimit -f`) for "
                "config.checkpoint.dir, or point it elsewhere")
    if any(k in low for k in ("permission", "read-only", "errno 13", "errno 30")):
        return "Fix the permissions of config.checkpoint.dir, or point it at a writable directory"
    return "Fix the cause above, or point config.checkpoint.dir at another directory"
