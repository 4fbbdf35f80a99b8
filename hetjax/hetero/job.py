"""A training job over islands: implements hetjax.job.Job, the contract train.py's loop
drives, with a list of the local islands' states as its state.

Virtual mode: every island lives in this process on its own slice of the local
devices, each runs its part of a step in its own thread, and links use the
`local` backend. Process mode: this process is one rank of one island (its own
jax.distributed world, hetjax.hetero.runtime) and holds only that island's part.
Either way an island runs the same code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import uuid
from concurrent import futures
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from hetjax import checkpoint, checkpoint_init, repro
from hetjax import state as state_lib
from hetjax import stop as stop_lib
from hetjax import config as config_lib
from hetjax import metrics as metrics_lib
from hetjax.compile import backend
from hetjax.errors import ConfigError, IslandLost
from hetjax.hetero import island as island_lib
from hetjax.hetero.peaks import island_agreed, peak_of_job
from hetjax.hetero.checkpoints import Checkpoints, check_saved_placement, held_by_all, saved_layers, steps_row
from hetjax.hetero.checkpoints import manager as island_manager
from hetjax.hetero import placement
from hetjax.hetero import runtime
from hetjax.hetero import scheduler
from hetjax.hetero import timeline as timeline_lib
from hetjax.hetero.links import Links
from hetjax.hetero.pipelined import PipelineStage
from hetjax.hetero.profile import seconds_per_layer
from hetjax.hetero.replicated import DataShare
from hetjax.pipeline import config as pipeline_config
from hetjax.transfer.core import run_async


def start(cfg) -> tuple[str, object]:
    """Sets up the backend for this process (before jax starts) and, in process mode,
    joins this island's jax.distributed world; (start-up line, runtime settings or None)."""
    if cfg.hetero.virtual:
        cpu = backend.resolve(cfg.compile)[0].platform == "cpu"
        line = backend.start_afresh_on_cpu(cfg, cpu)
        if cpu:
            # One virtual CPU device per island device: the islands partition them.
            need = sum(i.devices for i in cfg.hetero.islands)
            flags = os.environ.get("XLA_FLAGS", "")
            if "xla_force_host_platform_device_count" not in flags:
                backend.virtual_cpu_devices(need)
        return line + " (virtual islands: every island runs on a share of this process's devices)", None
    settings = scheduler.from_env(os.environ, cfg)
    if settings is None:
        raise ConfigError("config.hetero.virtual=False: start the islands' processes with "
                          "`python -m launch.local --config ...`, launch/slurm/hetjob.sbatch or "
                          "launch/k8s/jobset.yaml, which tell each process its island and rank")
    spec = next(i for i in cfg.hetero.islands if i.name == settings.island)
    platform = settings.stand_in or spec.platform
    line = backend.start_afresh_on_cpu(
        dataclasses.replace(cfg, compile=dataclasses.replace(cfg.compile, platform=platform)), platform == "cpu",
        startable=False)  # runtime.check_platform names the island's platform field instead
    runtime.initialize(settings, spec, cfg.hetero.timeout_s)
    checkpoint.barriers_without_collectives()  # an island of several processes saves mid-run
    where = f"island {settings.island} rank {settings.process_id}/{spec.num_processes} (from {settings.source})"
    stand_in = f" standing in for {spec.platform}" if settings.stand_in else ""
    return f"{line}; {where} on {platform}{stand_in}", settings


def agreed(cfg) -> dict:
    """What every island must agree on: everything but where each process runs."""
    # As the islands run it: virtual_stages 0 (automatic) and 1 agree there.
    d = config_lib.to_dict(pipeline_config.resolve(cfg, len(cfg.hetero.islands)))
    h = d["hetero"] = {k: v for k, v in d["hetero"].items() if k != "virtual"}
    for link in [h["link"], *h["links"]]:  # where a process listens and finds its secret
        for k in ("nic_addresses", "bind_address", "port", "secret_env", "secret_file"):
            link.pop(k)
    d["checkpoint"] = {k: d["checkpoint"][k] for k in ("every", "keep", "keep_every")}  # same steps
    for k in ("compile", "run_dir", "log_every", "tensorboard"):
        d.pop(k, None)
    return d


def _flat(d, prefix="") -> dict:
    out = {}
    for k, v in (d.items() if isinstance(d, dict) else ((f"[{i}]", x) for i, x in enumerate(d))):
        key = f"{prefix}{k}" if not prefix or k.startswith("[") else f"{prefix}.{k}"
        if isinstance(v, (dict, list)) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def differences(a: dict, b: dict) -> list[str]:
    fa, fb = _flat(a), _flat(b)
    return [f"config.{k}: {fa.get(k)!r} vs {fb.get(k)!r}" for k in sorted(set(fa) | set(fb))
            if fa.get(k) != fb.get(k)]


def gather_json(links: Links, value, what: str, mesh) -> list:
    """Every island's JSON-able `value`, in island order."""
    text = np.frombuffer(json.dumps(value, sort_keys=True).encode(), np.uint8)
    sizes = links.gather(np.asarray([text.size], np.int32), f"{what}/size", mesh)[:, 0]
    mine = np.zeros(int(sizes.max()), np.uint8)
    mine[:text.size] = text
    got = links.gather(mine, f"{what}/text", mesh)
    return [json.loads(row[:n].tobytes().decode()) for row, n in zip(got, sizes)]


def check_config(cfg, links: Links, mesh) -> None:
    """Islands whose configs disagree refuse to start, naming the difference. The first
    exchange of a job: nothing is compiled or allocated before it."""
    ours = json.loads(json.dumps(agreed(cfg), sort_keys=True))  # tuples as lists, like theirs
    names = [i.name for i in cfg.hetero.islands]
    for j, theirs in enumerate(gather_json(links, ours, "config", mesh)):
        diff = differences(ours, theirs)
        if diff:
            raise ConfigError(f"island {names[j]}'s config differs from island {names[links.k]}'s: "
                              f"{'; '.join(diff[:5])}; start every island with the same config")


class Worker:
    """One island's part of the job in this process."""

    def __init__(self, cfg, k: int, devices, layers, dataset, links: Links):
        self.k, self.name = k, cfg.hetero.islands[k].name
        self.island = island_lib.build(cfg, k, devices, layers)
        self.links = links
        self.manager = island_manager(cfg, self.name)
        # The checkpoint to resume, or config.init_from's, must fit this island's part: said
        # from its metadata before the island's programs compile, as for one mesh.
        if held := self.manager.steps():
            self.manager.check_usable(held[-1], {"params": self.island.abstract.params,
                                                 "opt_state": self.island.abstract.opt_state})
        elif cfg.init_from:  # a whole model, of which the island takes its part
            whole = state_lib.abstract_state(cfg.model, cfg.seed, self.island.tx)[1]
            checkpoint_init.check_params(cfg.init_from, whole.params)
        stage = PipelineStage if cfg.hetero.placement == "pipeline" else DataShare
        self.stage = stage(self.island, self.links)
        self.dataset, self.rows = dataset, self.island.rows
        self.timeline = self.island.timeline
        links.observe(self.timeline)
        self.seconds: dict[str, float] = {}  # the last step's breakdown (hetjax.hetero.timeline)

    def fingerprint_part(self, state) -> dict:
        """{tensor: (hash, norm)} of the parameters this island counts (hetjax.repro): its
        layers, and a shared or replicated tensor on one island only."""
        isl = self.island
        if not isl.chunks:  # data placement: every island holds the same whole model
            part = repro.param_fingerprint(state.params) if isl.first else repro.ParamFingerprint({})
        else:
            n, tied = isl.count, isl.cfg.model.tie_embeddings
            kept = [(p, v) for p, v in nnx.to_flat_state(state.params)
                    if island_lib.counts(p[0], isl.index, n, tied)]
            part = isl.fingerprint(nnx.from_flat_state(kept))
        return {k: (t.hash, t.norm) for k, t in part.tensors.items()}

    def train_step(self, state, batch, step: int, stop: bool):
        self.timeline.begin(step)
        self.links.status(f"step {step}")
        state, metrics, stops = self.stage.train_step(state, batch, f"train{step}", stop)
        self.timeline.settle()  # the update's own time is the step's compute, not the loop's
        self.seconds = self.timeline.end()
        return state, metrics, stops


class Batches:
    """Each local island's iterator over its rows of the global batches, in step."""

    def __init__(self, workers, dataset, start: int):
        self.its = [dataset.iterator(w.island.batch_shardings, start, share=w.rows) for w in workers]

    def __iter__(self):
        return self

    def __next__(self):
        return [next(it) for it in self.its]

    def get_state(self) -> dict:
        return self.its[0].get_state()

    def set_state(self, state: dict) -> None:
        for it in self.its:
            it.set_state(state)

    def close(self) -> None:
        for it in self.its:
            it.close()


class IslandsJob:
    """Every island of the job that lives in this process (a hetjax.job.Job)."""

    mesh = None  # islands have one each

    def __init__(self, cfg, dataset, settings=None, log=print):
        self.cfg, self.dataset, self.settings = cfg, dataset, settings
        h = cfg.hetero
        n = len(h.islands)
        local = list(range(n)) if settings is None else [[i.name for i in h.islands].index(settings.island)]
        devices = self._devices(local)
        # Virtual islands share this process's local mailbox: a job's own tags.
        job_id = "" if settings is not None else f"{uuid.uuid4().hex[:8]}:"
        links = {k: Links(cfg, k, settings, job_id) for k in local}
        self._links = list(links.values())
        meshes = {k: island_lib.make_mesh(island_lib.geometry(cfg, k), devices[k]) for k in local}
        self._run(local, lambda k: check_config(cfg, links[k], meshes[k]))
        layers = [()] * n  # the layers each island holds (pipeline placement)
        if h.placement == "pipeline":
            split = placement.island_layers(cfg) if not h.auto_split else None
            if h.auto_split:  # a resumed job keeps the split its checkpoints hold (saved_layers)
                saved = self._run(local, lambda k: links[k].gather(np.asarray(
                    [island_agreed(saved_layers(cfg, h.islands[k].name))], np.float32), "saved_split", meshes[k]))[0]
                if saved[:, 0].min() > 0 and saved[:, 0].sum() == cfg.model.num_layers:
                    split = tuple(int(n) for n in saved[:, 0])
                    log(f"auto_split: resuming with the split the checkpoints hold, {split}; not measured again")
            if split is None:  # rank 0's time: each process of an island measures its own
                times = self._run(local, lambda k: links[k].gather(
                    np.asarray([island_agreed(seconds_per_layer(cfg, meshes[k]))], np.float32), "profile",
                    meshes[k]))[0]
                split = placement.island_layers(cfg, placement.balance(times[:, 0].tolist()))
                log("auto_split: seconds per layer " + ", ".join(
                    f"{i.name} {t:.4g}" for i, t in zip(h.islands, times[:, 0])))
            layers = island_lib.held_layers(cfg, split)
        check_saved_placement(cfg, [h.islands[k].name for k in local],  # before compiling
                              {h.islands[k].name: sum(b - a for a, b in layers[k]) for k in local}
                              if h.placement == "pipeline" else None, dataset.fingerprint)
        for k in local:
            links[k].status("compiling")
        self.workers = self._run(local, lambda k: Worker(cfg, k, devices[k], layers[k], dataset, links[k]))
        for w in self.workers:
            log(w.island.describe())
        self.checkpoints = Checkpoints(self)
        self._stop = threading.Event()  # this process's request (SIGTERM)
        self._agreement = stop_lib.Agreement(self.workers[0].island.mesh)  # several processes: one island
        self.stop_requested = False  # every island's, agreed at the last step
        one = self.workers[0]  # process mode: the only one
        self.peak, self.peak_source = peak_of_job(cfg, [devices[k] for k in local], None if settings is None else
                                                  lambda mine: gather_json(one.links, island_agreed(mine), "peak",
                                                                           one.island.mesh))
        for k in local:
            links[k].status("restoring or initializing the state")
        restored = self.checkpoints.restore_latest([w.island.abstract for w in self.workers],
                                                   [w.island.shardings for w in self.workers], log)
        if restored is not None:
            self.state, self.start, data_state = restored.state, restored.step, restored.data_state
            log(f"resumed every island from step {self.start} of {self.checkpoints.directory}")
        else:
            self.state, self.start, data_state = self._fresh(log), cfg.data.start_step, None
        self.step_count = self.start
        self.batches = Batches(self.workers, dataset, self.start)
        if data_state is not None:
            self.batches.set_state(data_state)
        self.run_dir = Path(cfg.run_dir)
        self.writes_fingerprints = settings is None or (local[0] == 0 and settings.process_id == 0)
        if not self.writes_fingerprints:  # one writer of run_dir's files per job
            self.run_dir = self.run_dir / "islands" / f"{settings.island}-{settings.process_id}"
        self._digests: dict = {}  # step -> the end of its batch digest (digest_batch)
        self._identical = None  # the started comparison of parameters (check_identical)
        for w in self.workers:
            w.links.status("comparing the islands' first parameters")
        try:  # islands start from the same parameters; this also compiles the hashing before step 1
            self._start_identical(self.state, self.start)
            self.read_identical()
        except BaseException:
            self.close()
            raise

    def _devices(self, local):
        h = self.cfg.hetero
        if not h.virtual:
            return {local[0]: jax.devices()}
        need = [i.devices for i in h.islands]
        have = jax.devices()
        if sum(need) > len(have):
            raise ConfigError(
                f"config.hetero.islands need {sum(need)} devices in virtual mode "
                f"({' + '.join(map(str, need))}) but this process has {len(have)}; shrink the islands "
                f"or start with more (XLA_FLAGS=--xla_force_host_platform_device_count=N on CPU)")
        starts = np.concatenate([[0], np.cumsum(need)])
        return {k: have[starts[k]:starts[k + 1]] for k in range(len(need))}

    def _run(self, ks, fn):
        """fn(k) for every local island k at once: exchanges need all islands running.
        When one fails, its error is raised (not the other islands' IslandLost that
        follows it), and the links are closed so that the others stop waiting."""
        if len(ks) == 1:
            return [fn(ks[0])]
        running = [run_async(fn, k) for k in ks]  # daemon threads: a stuck one never blocks exit
        done, _ = futures.wait(running, return_when=futures.FIRST_EXCEPTION)
        errors = [f.exception() for f in done if f.exception() is not None]
        if errors:
            for links in self._links:
                links.close()
            # The others end once their links are closed, or their compile is done: a thread
            # still inside XLA as the interpreter exits aborts the process (exit 134, not 2).
            futures.wait(running, timeout=self.cfg.hetero.timeout_s)
            raise next((e for e in errors if not isinstance(e, IslandLost)), errors[0])
        return [f.result() for f in running]

    def _each(self, fn, *per_worker):
        """fn(worker, *args) on every local island at once (one thread each)."""
        return self._run(list(range(len(self.workers))),
                         lambda i: fn(self.workers[i], *(a[i] for a in per_worker)))

    def _fresh(self, log):
        if self.cfg.init_from:
            return self._each(lambda w: w.island.init_from(self.cfg.init_from))
        return self._each(lambda w: w.island.create_state())

    def agree_steps(self, steps: list[int], holds_any: bool) -> tuple[list[int], bool]:
        """(the checkpoint steps that every island holds, whether any island holds one)."""
        return self.start_agree_steps(steps, holds_any, "checkpoint/steps")()

    def start_agree_steps(self, steps: list[int], holds_any: bool, what: str):
        """agree_steps, started now; returns the wait for its answer (see Links.start_gather:
        read later, it never waits for a peer's next step)."""
        mine = np.append(steps_row(steps), np.int32(holds_any))  # the last entry: holds any
        ends = self._each(lambda w: w.links.start_gather(mine, what, w.island.mesh))

        def answer() -> tuple[list[int], bool]:
            got = self._each(lambda w, end: end(), ends)[0]
            return held_by_all(steps, got[:, :-1]), bool(got[:, -1].max())
        return answer

    def agreed_min(self, value: int, what: str) -> int:
        """The smallest of every island's `value`, on every island."""
        flags = self._each(lambda w: w.links.gather(np.asarray([value], np.int32), what, w.island.mesh))
        return int(flags[0].min())

    # -- what the training loop calls ------------------------------------------------

    def train_step(self, states, batches):
        step = self.step_count
        stop = self._agreement.passed_on(self._stop.is_set())  # by every process of the island's world
        out = self._each(lambda w, s, b: w.train_step(s, b, step, stop), states, batches)
        self.step_count += 1
        self.stop_requested = bool(np.any([o[2] for o in out]))
        values = dict(out[0][1])
        for w in self.workers:
            values[f"{w.name}/step_time"] = w.seconds["step"]
            values[f"{w.name}/transfer_time"] = sum(w.seconds[p] for p in timeline_lib.WAITS)
            values.update({f"{w.name}/{p}": w.seconds[p] for p in (*timeline_lib.PARTS, "host_copy", "loop")})
        return [o[0] for o in out], values

    def request_stop(self) -> None:
        self._stop.set()

    def eval_sums(self, states, i: int) -> dict:
        def run(w, state):
            batch = self.dataset.eval_batch(i, w.island.batch_shardings, share=w.rows)
            return w.stage.eval_sums(state.params, batch, f"eval{self.step_count}.{i}")
        loss, tokens = self._each(run, states)[0]
        return {"loss_sum": loss, "tokens": tokens}

    def digest_batch(self, step: int, batches) -> None:
        """Starts the fingerprint of step `step`'s global batch (hetjax.repro). With data
        placement, each island's share of it is hashed and sent to the others now, before
        the step, and read after the next one (batch_digest): read at once, the exchange
        could wait a whole step for a peer that had already started its next one."""
        if self.cfg.hetero.placement == "pipeline":  # every island holds the whole batch
            # Island 0's copy, and only where the fingerprints are written: each other
            # process skipped 1.5 ms a step of work it threw away. Every process of island 0
            # runs the hashing program, which spans that island's processes.
            if self.workers[0].island.index != 0:
                self._digests[step] = lambda: None
                return
            words = repro.batch_words(batches[0])
            self._digests[step] = lambda: repro.combine_rows(words) if self.writes_fingerprints else None
            return
        words = [repro.batch_words(b) for b in batches]

        def shares() -> list[int]:
            return [repro.combine_rows(w, rows=wk.rows[0]) for w, wk in zip(words, self.workers)]
        if self.settings is None:  # virtual islands: every share is in this process, nothing to send
            self._digests[step] = lambda: sum(shares()) % 2**64
            return
        mine = shares()[0]  # one island per process
        w = self.workers[0]
        table = w.links.start_gather(np.asarray([mine & 0xFFFFFFFF, mine >> 32], np.uint32),
                                     f"digest{step}", w.island.mesh)

        def digest() -> int:
            got = table().astype(np.uint64)
            return sum(int(lo) | (int(hi) << 32) for lo, hi in got) % 2**64
        self._digests[step] = digest

    def batch_digest(self, step: int) -> int | None:
        """The global batch's digest: island 0's (pipeline: each holds it whole; None in a
        process that does not write the fingerprints), or the sum of the islands' row shares (data)."""
        return self._digests.pop(step)()

    def param_fingerprint(self, states) -> repro.ParamFingerprint:
        """The whole model's fingerprint: the sum of every island's part."""
        parts = self._each(lambda w, s: w.fingerprint_part(s), states)
        if self.settings is not None:
            w = self.workers[0]
            parts = gather_json(w.links, parts[0], f"params{self.step_count}", w.island.mesh)
        total = repro.ParamFingerprint({})
        for part in parts:
            total = total + repro.ParamFingerprint({k: repro.TensorPrint(int(h), float(v))
                                                    for k, (h, v) in part.items()})
        return total

    def check_identical(self, states, step: int) -> None:
        """Data placement: every fingerprint_every steps (and at the start), islands compare
        parameter hashes. A comparison is read at the next call, one step later, so that no
        island waits between steps for a peer already in its next step; it is read at once
        on the last step, and before any checkpoint is saved (read_identical)."""
        self.read_identical()
        every = self.cfg.hetero.fingerprint_every
        if every and step % every == 0:
            self._start_identical(states, step)
            if step >= self.cfg.steps:
                self.read_identical()

    def _start_identical(self, states, step: int) -> None:
        if self.cfg.hetero.placement == "data" and self.cfg.hetero.fingerprint_every:
            self._identical = self._each(lambda w, s: w.stage.check_identical(s.params, f"fingerprint{step}"),
                                         states)

    def read_identical(self) -> None:
        """Reads the comparison check_identical started, if any (IslandsDiverged if the
        islands differ): a checkpoint of diverged islands would resume nothing good."""
        if self._identical is not None:
            ends, self._identical = self._identical, None
            self._each(lambda w, end: end(), ends)

    def flops_per_step(self) -> float:
        num_params = metrics_lib.num_params(self.cfg.model)
        return metrics_lib.model_flops_per_token(self.cfg, num_params) * self.cfg.batch_size * self.cfg.seq_len

    def close(self) -> None:
        for w in self.workers:
            w.timeline.write(self.cfg.run_dir)
        for links in self._links:
            links.close()
