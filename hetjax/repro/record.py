"""What every training run writes: `run_dir/fingerprints.jsonl`.

One JSON object per line:

  {"kind": "header", "step": start, platform, device_kind, jax, jaxlib, mesh, profile, ...}
      once per start of the program (a resumed run adds one at the step it resumed)
  {"kind": "step", "step": s, "loss": ..., "grad_norm": ..., "batch": "16 hex digits"}
      every step: the step's metrics and the digest of its global batch
  {"kind": "params", "step": s, "params": "16 hex digits", "norm": ..., "hashes": {...}, "norms": {...}}
      the parameters after s steps: at the start, every config.fingerprint_every steps
      and at the end; per tensor in the model layout, per layer of `blocks`

Floats are written with Python's shortest round-trip repr, so a loss read back is the
fp32 value that was computed, bit for bit. Every process computes the digests (they are
collectives over the global arrays); only process 0 writes.
"""

from __future__ import annotations

import json
import os
import platform as platform_lib
from pathlib import Path

import jax

from hetjax import metrics
from hetjax.config import to_dict
from hetjax.errors import ConfigError
from hetjax.repro import digest as fp

FILE = "fingerprints.jsonl"


def header(cfg, mesh, start: int, extra: dict | None = None) -> dict:
    """Where and how a run (or its resumed part) ran; mesh None: this process's devices."""
    from hetjax.compile import backend
    device = jax.devices()[0] if mesh is None else mesh.devices.flat[0]
    try:
        import jaxlib
        jaxlib_version = jaxlib.__version__
    except (ImportError, AttributeError):
        jaxlib_version = "?"
    return {"kind": "header", "step": start, "platform": device.platform, "device_kind": device.device_kind,
            "jax": jax.__version__, "jaxlib": jaxlib_version, "python": platform_lib.python_version(),
            "mesh": {} if mesh is None else {k: int(v) for k, v in mesh.shape.items()},
            "profile": backend.resolve(cfg.compile)[0].name, "processes": jax.process_count(),
            "devices": jax.device_count() if mesh is None else int(mesh.devices.size),
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "config": to_dict(cfg), **(extra or {})}


class Recorder:
    """Writes a run's fingerprints. In the training loop:

        recorder = Recorder(run_dir, cfg, mesh, plan, start)
        recorder.params(start, state.params)
        state, m = train_step(state, recorder.batch(s, batch))   # starts the batch digest
        recorder.params(s + 1, state.params)                      # when due
        recorder.step(s, host_metrics)                            # when the metrics are read
        recorder.close()

    Islands pass mesh=None and `extra` (e.g. {"islands": ...}) for the header, write=True
    in exactly one process of the job, and write the sum of their parts' fingerprints
    with `write_params` when `due(step)`.
    """

    def __init__(self, run_dir: Path, cfg, mesh=None, plan=None, start: int = 0, extra: dict | None = None,
                 write: bool | None = None):
        self.every, self.last = cfg.fingerprint_every, cfg.steps
        self.start = start
        self.layout = None if plan is None else plan.layout
        self.pending: dict[int, dict] = {}
        self.file = None
        if write is None:  # islands are separate jax worlds: they say which process writes
            write = jax.process_index() == 0
        if write:
            metrics.truncate(run_dir, start, FILE)  # rows of steps >= start will be written again
            self.file = open(run_dir / FILE, "a", buffering=1)
            self._write(header(cfg, mesh, start, extra))

    def _write(self, row: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")

    def batch(self, step: int, batch: dict) -> dict:
        """Starts the digest of step `step`'s global batch; returns the batch unchanged."""
        self.pending[step] = fp.batch_words(batch)
        return batch

    def step(self, step: int, values: dict, batch_digest: int | None = None) -> None:
        """Writes step `step`'s loss, gradient norm (values: host scalars) and batch digest:
        `batch_digest` if given (e.g. the sum of the islands' parts), else that of `batch()`."""
        words = self.pending.pop(step, None)
        if self.file is None:  # not the writing process: nothing to hash
            return
        if batch_digest is None:
            batch_digest = fp.combine_rows(words)
        self._write({"kind": "step", "step": step, "loss": float(values["loss"]),
                     "grad_norm": float(values["grad_norm"]), "batch": fp.hex64(batch_digest)})

    def due(self, step: int) -> bool:
        return step in (self.start, self.last) or (self.every > 0 and step % self.every == 0)

    def params(self, step: int, params) -> None:
        """Writes the fingerprint of the parameters after `step` steps, if this step is due."""
        if self.due(step):
            self.write_params(step, fp.param_fingerprint(params, layout=self.layout))

    def write_params(self, step: int, fingerprint: fp.ParamFingerprint) -> None:
        """Writes a fingerprint computed elsewhere (e.g. the sum of the islands' parts)."""
        self._write({"kind": "params", "step": step, **fingerprint.to_json()})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def read(run_dir: str | Path) -> tuple[list[dict], dict[int, dict], dict[int, dict]]:
    """(headers, step rows by step, params rows by step) of a run directory."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no {FILE} here; give the run_dir of a hetjax.train run "
                          f"(runs write it since config.fingerprint_every was added)")
    headers, steps, params = [], {}, {}
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # a torn last line of a killed run
            raise ConfigError(f"{path}:{number}: not a JSON line; the file is damaged (only a killed run's last "
                              f"line may be torn)") from None
        if row.get("kind") == "header":
            headers.append(row)
        elif row.get("kind") == "step":
            steps[row["step"]] = row
        elif row.get("kind") == "params":
            params[row["step"]] = row
    return headers, steps, params
