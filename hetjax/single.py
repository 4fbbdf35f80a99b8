"""A training job on one mesh (no islands), with the interface train.py's loop uses
for any job: `state`, `start`, `batches`, `train_step`, `eval_sums`, `checkpoints`,
`stop_requested`, `peak`, `flops_per_step()`, `run_dir`."""

from __future__ import annotations

import math
import time
from pathlib import Path

from hetjax import checkpoint, memory, metrics, pipeline, repro, sharding
from hetjax.compile import aot
from hetjax.mesh import describe, make_mesh


class Job:
    """Builds (abstractly first), compiles, and restores or initialises the state."""

    writes_fingerprints = None  # process 0 writes (hetjax.repro.Recorder)

    def __init__(self, cfg, dataset, compile_only: bool = False, log=print):
        self.cfg, self.dataset = cfg, dataset
        self._batch_words: dict = {}
        # Everything below up to create_state is abstract: no parameter is allocated.
        mesh = make_mesh(cfg.mesh)
        prog = aot.program(cfg, mesh)  # checks that the model splits over the mesh
        plan, tx, graphdef, abstract_state = prog.plan, prog.tx, prog.graphdef, prog.state
        layouts, state_shardings = prog.layouts, prog.state_shardings
        self.batch_shardings = prog.batch_shardings
        replicated = sharding.check_replication(layouts, mesh, cfg.sharding.max_replicated_fraction)
        self.num_params = sum(math.prod(l.shape) for l in layouts)
        estimate = memory.estimate(cfg, layouts, mesh)
        log(f"{cfg.name}: {self.num_params:,} parameters on mesh {describe(mesh)} "
            f"({mesh.devices.flat[0].device_kind}); {replicated:.1%} of parameter bytes replicated; "
            f"needs {estimate.describe()}")
        if plan is not None:
            log(plan.describe())
        self.mesh, self.plan = mesh, plan
        if not compile_only:
            memory.check_fits(cfg, estimate, mesh)

        t0 = time.perf_counter()
        self.compiled = pipeline.compile_train_step(cfg, graphdef, tx, abstract_state, state_shardings, mesh, plan)
        log(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
        if compile_only:
            return
        self.run_dir = Path(cfg.run_dir)
        self.checkpoints = checkpoint.Manager(checkpoint.default_dir(cfg), cfg.checkpoint)
        # Resume the run's own checkpoint if it has one (same run_dir, no flag); else
        # start from config.init_from's weights; else initialise.
        restored = self.checkpoints.restore_latest(abstract_state, state_shardings)
        if restored is not None:
            self.state, self.start = restored.state, restored.step
            log(f"resumed from step {self.start} of {self.checkpoints.directory} "
                f"(parameter fingerprint {restored.meta['params_fingerprint']})")
        elif cfg.init_from:
            params = checkpoint.load_params(cfg.init_from, abstract_state.params, state_shardings.params)
            self.state, self.start = checkpoint.fresh_state(params, tx, state_shardings), cfg.data.start_step
        else:
            self.state, self.start = pipeline.create_state(cfg, tx, state_shardings, plan), cfg.data.start_step
        self.eval_step = pipeline.compile_eval_step(cfg, graphdef, abstract_state.params,
                                                    state_shardings.params, mesh, plan)
        self.batches = dataset.iterator(self.batch_shardings, self.start)
        if restored is not None:
            self.batches.set_state(restored.data_state)  # refuses a state saved for other data
            assert self.batches.get_state()["step"] == self.start, (self.batches.get_state(), self.start)
        self.peak, self.peak_source = metrics.peak_flops(cfg, list(mesh.devices.flat))
        self.preempted: list = []

    @property
    def stop_requested(self) -> bool:
        return bool(self.preempted)

    def train_step(self, state, batch):
        return self.compiled(state, batch)

    def eval_sums(self, state, i: int) -> dict:
        return self.eval_step(state.params, self.dataset.eval_batch(i, self.batch_shardings))

    def digest_batch(self, step: int, batch) -> None:
        """Starts the fingerprint of step `step`'s global batch (hetjax.repro)."""
        self._batch_words[step] = repro.batch_words(batch)

    def batch_digest(self, step: int) -> int:
        return repro.combine_rows(self._batch_words.pop(step))

    def param_fingerprint(self, state) -> repro.ParamFingerprint:
        return repro.param_fingerprint(state.params, layout=None if self.plan is None else self.plan.layout)

    def check_identical(self, state, step: int) -> None:
        """One mesh holds one copy of the parameters: nothing to compare."""

    def flops_per_step(self) -> float:
        return metrics.model_flops_per_token(self.cfg, self.num_params) * self.cfg.batch_size * self.cfg.seq_len

    def close(self) -> None:
        pass
