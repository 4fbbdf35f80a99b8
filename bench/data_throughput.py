"""Tokens/s the data pipeline delivers against tokens/s the train step consumes, in one run.

    python -m bench.data_throughput [--config configs/tiny.py] [--steps N] [--pipeline-steps P]
        [--prepared] [--config.KEY=VALUE ...]

--prepared: the data are real text shards instead: 20,000 JSONL documents of words
(gzip) tokenized by `python -m hetjax.data.prepare` (byte tokenizer, 2 processes)
into a temporary directory, read through the memory-mapped array_record source
(config.data.source=array_record; config.model.vocab_size raised to 320 for the
byte tokenizer's 257 ids).

- train step: the config's compiled train step (hetjax.program's compile_train_step, state
  donated) over N batches made and placed beforehand, so it pays no data cost;
  the clock stops when the last step's metrics are on the host.
- pipeline: hetjax's grain data iterator (data.build(cfg).iterator) with 0 and
  with 2 grain worker processes, P global batches each (default 1000: the pipeline
  is ten times faster than the step, and 50 batches last ~0.1 s, too short to time
  on a shared machine), as sharded jax.Arrays ready on the devices; worker start-up
  (before the first batch) is not timed.

Both on the config's mesh and batch shape; the last line is the ratio of the
pipeline's tokens/s to the train step's (the target is >= 10: the data never
holds a step back).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import jax

from bench import common
from hetjax import config as config_lib
from hetjax import data, program
from hetjax.compile import cli
from hetjax.mesh import describe, make_mesh


def parse(argv: list[str]) -> tuple[config_lib.Config, int, int]:
    cfg, opts = common.parse(argv, {"--steps": (50, 1), "--pipeline-steps": (1000, 1)}, ("--prepared",), doc=__doc__)
    cfg = dataclasses.replace(cfg, steps=max(cfg.steps, opts["steps"] + 1, opts["pipeline_steps"] + 2))
    if opts["prepared"]:
        cfg = prepared_corpus(cfg)
    config_lib.validate(cfg)
    return cfg, opts["steps"], opts["pipeline_steps"]


def prepared_corpus(cfg):
    """cfg reading a corpus of words prepared here (kept until the process exits)."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    from bench.prepare_throughput import corpus
    from hetjax.data import prepare

    root = Path(tempfile.mkdtemp(prefix="hetjax-bench-"))
    atexit.register(shutil.rmtree, root, True)
    corpus(root / "c.jsonl.gz", 20_000)
    prepare.prepare(str(root / "c.jsonl.gz"), str(root / "prepared"), progress=False, processes=2)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=max(cfg.model.vocab_size, 320)),
        data=dataclasses.replace(cfg.data, source="array_record", path=str(root / "prepared")))


def train_step_rate(cfg, mesh, batches) -> float:
    prog = program.build(cfg, mesh)
    train_step, state = prog.compile_train_step(), prog.init_state()
    state, m = train_step(state, batches[0])  # warm up
    jax.block_until_ready(m)
    t = time.perf_counter()
    for b in batches:
        state, m = train_step(state, b)
    jax.device_get(m)
    return len(batches) * cfg.batch_size * cfg.seq_len / (time.perf_counter() - t)


def pipeline_rate(dataset, shardings, steps: int, workers: int) -> float:
    dataset.num_workers = workers
    it = dataset.iterator(shardings)
    try:
        jax.block_until_ready(next(it))  # worker start-up is not timed
        t = time.perf_counter()
        for _ in range(steps):
            batch = next(it)
        jax.block_until_ready(batch)
        return steps * dataset.batch_size * dataset.train.seq_len / (time.perf_counter() - t)
    finally:
        it.close()


def main(argv: list[str] | None = None) -> int:
    cfg, steps, pipeline_steps = parse(sys.argv[1:] if argv is None else argv)
    mesh = make_mesh(cfg.mesh)
    shardings = program.batch_shardings(mesh, cfg.sharding.rules)
    dataset = data.build(cfg)
    print(f"{cfg.name}: batch {cfg.batch_size} x {cfg.seq_len} on mesh {describe(mesh)} "
          f"({mesh.devices.flat[0].device_kind}); data {dataset.description}; {steps} train steps, "
          f"{pipeline_steps} pipeline batches",
          flush=True)
    batches = jax.block_until_ready([dataset.batch(s, shardings) for s in range(steps)])
    consumed = train_step_rate(cfg, mesh, batches)
    print(f"train step consumes {consumed:12,.0f} tokens/s", flush=True)
    delivered = {}
    for workers in (0, 2):
        delivered[workers] = pipeline_rate(dataset, shardings, pipeline_steps, workers)
        print(f"pipeline, {workers} workers {delivered[workers]:12,.0f} tokens/s", flush=True)
    print(f"tokens/s ratio pipeline/train step: {delivered[0] / consumed:.1f} with 0 workers, "
          f"{delivered[2] / consumed:.1f} with 2 workers", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
