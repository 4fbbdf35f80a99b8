"""The job contract that hetjax/train.py's loop drives (`Job`), and the one-mesh job
(`MeshJob`). The islands' job (hetjax.hetero.job.IslandsJob) implements the same contract."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import jax
import numpy as np

from hetjax import checkpoint, checkpoint_fit, checkpoint_init, checkpoint_readable, memory, metrics, program, repro
from hetjax import sharding
from hetjax import stop as stop_lib
from hetjax.compile import aot, backend, hlo
from hetjax.data.pipeline import check_saved_state
from hetjax.errors import ConfigError
from hetjax.mesh import describe, make_mesh
from hetjax import state as state_lib
from hetjax.pipeline.stages import StageLayout, permute_layers, to_stages


class Checkpoints(Protocol):
    """What the loop asks of a job's checkpoints (hetjax.checkpoint.Manager, or one per island)."""

    directory: Path

    def should_save(self, step: int) -> bool: ...
    def save(self, step: int, state: Any, data_state: dict, config: dict) -> None: ...
    def wait(self) -> None: ...
    def steps(self) -> list[int]: ...
    def close(self) -> None: ...


class Batches(Protocol):
    """The job's batch iterator, whose position a checkpoint saves."""

    def __next__(self) -> Any: ...
    def get_state(self) -> dict: ...
    def set_state(self, state: dict) -> None: ...
    def close(self) -> None: ...


class Job(Protocol):
    """Everything hetjax/train.py's loop uses of a job, and nothing else."""

    state: Any  # the train state to start from (restored or fresh); opaque to the loop
    start: int  # the first step to run
    batches: Batches  # positioned at `start`
    checkpoints: Checkpoints
    mesh: Any  # the job's one Mesh, or None when it has several (islands)
    run_dir: Path  # where this process writes metrics and fingerprints
    peak: float  # peak FLOP/s of the job's devices, for MFU
    peak_source: str  # where `peak` comes from, for the log
    writes_fingerprints: bool | None  # repro.Recorder's `write` (None: process 0 writes)

    def train_step(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """One optimizer step: (new state, its metrics, possibly still on the device)."""

    def eval_sums(self, state: Any, i: int) -> dict:
        """{"loss_sum", "tokens"} of eval batch i."""

    def digest_batch(self, step: int, batch: Any) -> None:
        """Starts the digest of step `step`'s global batch (hetjax.repro)."""

    def batch_digest(self, step: int) -> int | None:
        """The digest started by digest_batch(step), completed (islands may wait for a
        peer's share of it); None in a process that does not write the fingerprints."""

    def param_fingerprint(self, state: Any) -> repro.ParamFingerprint:
        """The whole model's parameter fingerprint, independent of layout."""

    def check_identical(self, state: Any, step: int) -> None:
        """Raises if copies of the parameters that must agree bit for bit do not; a job may
        raise for step s at its next call instead (islands: one step later), but before
        it saves a checkpoint and at once on the last step."""

    def flops_per_step(self) -> float:
        """Model FLOPs of one step (6N + attention), for MFU."""

    @property
    def stop_requested(self) -> bool:
        """Should the loop save and stop after this step (agreed by every part of the job)?"""

    def request_stop(self) -> None:
        """Asks the job to stop at the next step boundary (SIGTERM's handler calls it)."""

    def close(self) -> None:
        """Releases what the job holds (links, timelines)."""


def start(cfg) -> tuple[str, object]:
    """Sets up the backend (before jax starts) and, where a scheduler started this one-mesh
    job as several processes (launch.local --processes, srun -n N, a Kubernetes Indexed
    Job), joins them into one jax.distributed world; (start-up line, settings or None)."""
    from hetjax.hetero import runtime, scheduler
    world = scheduler.mesh_world(os.environ, cfg)
    if world is None:
        return backend.start(cfg), None
    platform, note = backend.resolve(cfg.compile)[0].platform, ""
    if world.stand_in:  # launch.local --stand_in, HETJAX_STAND_IN: its profile, not the config's
        platform, note = world.stand_in, f"; {world.stand_in} standing in for {platform}"
        cfg = dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, platform=platform))
    line = backend.start_afresh_on_cpu(cfg, platform == "cpu", "the CPU processes of one world") + note
    island = scheduler.one_island(cfg, world.num_processes, _local_devices(cfg, platform, world.num_processes),
                                  platform).hetero.islands[0]
    runtime.initialize(world, island, cfg.hetero.timeout_s)  # gloo across processes on CPU
    checkpoint.barriers_without_collectives()
    return (f"{line}; process {world.process_id} of {world.num_processes} in one jax.distributed world "
            f"(coordinator {world.coordinator}, from {world.source})"), world


def _local_devices(cfg, platform: str, processes: int) -> int:
    """The devices each process of a one-mesh world must see."""
    from hetjax.hetero import scheduler
    per = scheduler.mesh_devices_per_process(cfg, processes)
    if per is not None:
        return per
    if platform == "cpu":
        return backend.cpu_device_count() or 1
    visible = os.environ.get({"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}.get(platform, ""), "")
    if visible:
        return len(visible.split(","))
    raise ConfigError(f"config.mesh has a -1 axis, so it cannot say how many {platform} devices each of the "
                      f"{processes} processes holds; give every mesh axis its size (e.g. "
                      f"--config.mesh.fsdp=N), or set CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES")


def _init_layout(cfg, prog, split) -> tuple[bool, Any]:
    """(whether config.init_from's checkpoint holds the model's layer order while this run
    stacks an uneven split's padded rows, the abstract state to read it as)."""
    if split is not None and checkpoint_fit.padded_split(checkpoint_init.saved_config(cfg.init_from)) is None:
        return True, state_lib.abstract_state(cfg.model, cfg.seed, prog.tx)[1]
    return False, prog.state


class MeshJob:
    """A training job on one mesh (no islands): builds its program abstractly first,
    compiles, and restores or initialises the state."""

    writes_fingerprints = None  # process 0 writes (hetjax.repro.Recorder)

    def __init__(self, cfg, dataset, compile_only: bool = False, log=print):
        self.cfg, self.dataset = cfg, dataset
        self._batch_words: dict = {}
        self._stop = threading.Event()  # this process's request (SIGTERM)
        # Everything below up to init_state is abstract: no parameter is allocated.
        mesh = make_mesh(cfg.mesh)
        prog = program.build(cfg, mesh)  # checks that the model splits over the mesh
        self.batch_shardings = prog.batch_shardings
        replicated = sharding.check_replication(prog.layouts, mesh, cfg.sharding.max_replicated_fraction)
        self.num_params = metrics.num_params(cfg.model)  # not prog.layouts: a pipeline's hold padding
        estimate = memory.estimate(cfg, prog.layouts, mesh)
        log(f"{cfg.name}: {self.num_params:,} parameters on mesh {describe(mesh)} "
            f"({mesh.devices.flat[0].device_kind}); {replicated:.1%} of parameter bytes replicated; "
            f"needs {estimate.describe()}")
        if prog.plan is not None:
            chosen = (f" (config.pipeline.virtual_stages=0 chose {prog.plan.layout.virtual}: set it to fix the "
                      f"chunks per stage)") if cfg.pipeline.virtual_stages == 0 else ""
            log(prog.plan.describe() + chosen)
        if cfg.sharding.grad_sync == "once" and mesh.shape["data"] > 1:
            log(f"gradients summed over data={mesh.shape['data']} once a step (config.sharding.grad_sync)")
        self.mesh, self.plan = mesh, prog.plan
        self._agreement = stop_lib.Agreement(mesh)
        if not compile_only:
            memory.check_fits(cfg, estimate, mesh)

        if not compile_only:
            directory = checkpoint.default_dir(cfg)
            checkpoint_readable.check_shared(directory, cfg.hetero.timeout_s)
            self.checkpoints = checkpoint.Manager(directory, cfg.checkpoint,
                                                  peer_timeout_s=cfg.hetero.timeout_s)
            # An uneven split's padded rows: (3, 1) and (1, 3) have the same shapes, and a
            # checkpoint of one would load into the other scrambled (checkpoint_fit.check_split).
            # Checked for an even run too: a padded checkpoint's shapes are not the model's, and
            # the shape check's advice (change config.model) was wrong there.
            split = tuple(cfg.pipeline.stage_layers) if prog.plan is not None and prog.plan.layout.padded else None
            check = lambda config, where: checkpoint_fit.check_split(  # noqa: E731
                config, split, where, "resume with that split (config.mesh.pipeline and "
                                      "config.pipeline.stage_layers); no other uneven split can read this checkpoint")
            # The checkpoint to resume (or config.init_from's) must fit this run: said from
            # its metadata before the compile, not after it. (An interleaved pipeline's layers
            # are a permutation of the model's, of the same shapes.)
            init_abstract = None  # config.init_from's layout, once read
            try:
                if saved := self.checkpoints.steps():
                    checkpoint_fit.check_resumable(self.checkpoints)
                    checkpoint_fit.check_not_past(cfg, saved[-1], self.checkpoints.directory)
                    self.checkpoints.check_usable(saved[-1], {"params": prog.state.params,
                                                              "opt_state": prog.state.opt_state}, check)
                    if (state := self.checkpoints.read_json_or_none(saved[-1], "data")) is not None:
                        check_saved_state(state, dataset.fingerprint)
                elif cfg.init_from:
                    model_order, init_abstract = _init_layout(cfg, prog, split)  # read below too
                    checkpoint_init.check_params(cfg.init_from, init_abstract.params, log,
                                                 None if model_order else split, cfg.model)
            except BaseException:
                self.checkpoints.close()  # no orbax thread outlives a refused start
                raise

        t0 = time.perf_counter()
        self.compiled = prog.compile_train_step()
        log(f"compiled the train step in {time.perf_counter() - t0:.1f}s")
        if compile_only:
            return
        self.run_dir = Path(cfg.run_dir)
        if jax.process_index():  # one writer of run_dir's files per job: process 0
            self.run_dir = self.run_dir / "processes" / str(jax.process_index())
        if prog.plan is not None and prog.plan.layout.virtual > 1:
            self.checkpoints = ModelOrderCheckpoints(self.checkpoints, prog.plan.layout, prog.state_shardings)
        # Resume the run's own checkpoint if it has one (same run_dir, no flag); else
        # start from config.init_from's weights; else initialise.
        restored = self.checkpoints.restore_latest(prog.state, prog.state_shardings, log, check)
        if restored is not None:
            self.state, self.start = restored.state, restored.step
            log(f"resumed from step {self.start} of {self.checkpoints.directory} "
                f"(parameter checksum {checkpoint.params_checksum_of(restored.meta)})")
        elif cfg.init_from:  # check_params warned of model differences
            if init_abstract is None:  # a checkpoint was there before the compile, and is gone
                model_order, init_abstract = _init_layout(cfg, prog, split)
            if model_order:  # an unpipelined run's or an import's layers, into the split's padded rows
                # Read split over the stages where the layers divide among them; else each stage
                # holds every layer until to_stages (the stages x its own for that moment).
                rules = (program.rules(cfg, prog.plan) if cfg.model.num_layers % prog.plan.stages == 0
                         else cfg.sharding.rules)
                shardings = sharding.state_shardings(init_abstract, mesh, rules)
                params = checkpoint_init.load_params(cfg.init_from, init_abstract.params, shardings.params, log)
                params = jax.jit(lambda p: to_stages(p, prog.plan.layout),
                                 out_shardings=prog.state_shardings.params)(params)
            else:
                params = checkpoint_init.load_params(cfg.init_from, prog.state.params, prog.state_shardings.params,
                                                     log, split)
            if isinstance(self.checkpoints, ModelOrderCheckpoints):
                params = self.checkpoints.to_pipeline(params, prog.state_shardings.params)
            self.state, self.start = checkpoint_init.fresh_state(params, prog.tx, prog.state_shardings), cfg.data.start_step
        else:
            self.state, self.start = prog.init_state(), cfg.data.start_step
        self.eval_step = prog.compile_eval_step()
        self.batches = dataset.iterator(self.batch_shardings, self.start)
        if restored is not None:
            self.batches.set_state(restored.data_state)  # refuses a state saved for other data
            assert self.batches.get_state()["step"] == self.start, (self.batches.get_state(), self.start)
        self.peak, self.peak_source = metrics.peak_flops(cfg, list(mesh.devices.flat))

    @property
    def stop_requested(self) -> bool:
        return self._agreement.result() if jax.process_count() > 1 else self._stop.is_set()

    def request_stop(self) -> None:
        self._stop.set()

    def train_step(self, state, batch):
        self._agreement.propose(self._stop.is_set())  # agreed by every process; read after the step
        return self.compiled(state, batch)

    def eval_sums(self, state, i: int) -> dict:
        return self.eval_step(state.params, self.dataset.eval_batch(i, self.batch_shardings))

    def digest_batch(self, step: int, batch) -> None:
        self._batch_words[step] = repro.batch_words(batch)

    def batch_digest(self, step: int) -> int | None:
        words = self._batch_words.pop(step)  # every process ran the hashing program (it spans them)
        return repro.combine_rows(words) if jax.process_index() == 0 else None  # the Recorder's writer

    def param_fingerprint(self, state) -> repro.ParamFingerprint:
        return repro.param_fingerprint(state.params, layout=None if self.plan is None else self.plan.layout)

    def check_identical(self, state, step: int) -> None:
        """One mesh holds one copy of the parameters: nothing to compare."""

    def flops_per_step(self) -> float:
        return metrics.model_flops_per_token(self.cfg, self.num_params) * self.cfg.batch_size * self.cfg.seq_len

    def compile_report(self) -> list[str]:
        """The compiled step's memory and FLOP figures per device (`--compile_only`)."""
        report = aot.analysis(self.compiled)
        # XLA's cost analysis counts the scanned layer loop's body once: count every trip.
        counted = hlo.summarize(self.compiled.as_text(), jax.device_count())
        report = {k: v for k, v in report.items() if k != "bytes_accessed"} | {
            "flops": counted["flops"], "matmul_bytes": counted["matmul_bytes"]}
        lines = [f"  {key:>22}: {f'{value / memory.GiB:.3f} GiB' if key.endswith('bytes') else f'{value:.4g}'} "
                 f"per device" for key, value in report.items()]
        return lines + [f"  {'model_flops':>22}: {self.flops_per_step():.4g} per step (6N + attention)"]

    def close(self) -> None:
        pass


class ModelOrderCheckpoints:
    """An interleaved pipeline's checkpoints (config.pipeline.virtual_stages > 1), kept in
    the model's layer order. Its stacked layers are a permutation of the model's with the
    same shapes, so a checkpoint in that order would restore into any other layout without
    an error and with its layers scrambled; saved in model order, it is interchangeable
    with every layout's (as the unpipelined and uninterleaved ones are)."""

    def __init__(self, manager: checkpoint.Manager, layout: StageLayout, shardings):
        self._manager = manager
        self._source = layout.source()  # the model layer at each pipeline position
        self._to_model = jax.jit(lambda s: permute_layers(s, np.argsort(self._source)), out_shardings=shardings)

    def __getattr__(self, name):  # everything but save and restore_latest is the manager's
        return getattr(self._manager, name)

    def to_pipeline(self, tree, shardings):
        """A tree in the model's layer order (a state or parameters) in the pipeline's."""
        return jax.jit(lambda t: permute_layers(t, self._source), out_shardings=shardings)(tree)

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        self._manager.save(step, self._to_model(state), data_state, config)

    def restore_latest(self, abstract_state, shardings, log=print, check=None):
        restored = self._manager.restore_latest(abstract_state, shardings, log, check)
        if restored is None:
            return None
        return dataclasses.replace(restored, state=self.to_pipeline(restored.state, shardings))
