"""Per-step metrics: JSONL and TensorBoard writers, a progress bar, and MFU."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import queue
import sys
import threading
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hetjax import cli
from hetjax import state as state_lib
from hetjax.compile import hardware
from hetjax.errors import ConfigError, TrainingDiverged

# Dense bf16 peak per device, FLOP/s, from the vendors' data sheets (hetjax.compile.hardware).
PEAK_FLOPS = {name: hw.peak_flops for name, hw in hardware.TABLE.items()}


def num_params(model_cfg) -> int:
    """The model's parameters, counted on its abstract shapes: a pipeline's layouts hold
    padding layer slots (uneven config.pipeline.stage_layers) that are not the model's."""
    model = nnx.eval_shape(lambda: state_lib.make_model(model_cfg, 0))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model)))


def model_flops_per_token(cfg, num_params: int) -> float:
    """Training FLOPs per token: 6 per matmul parameter plus attention (PaLM's formula)."""
    m = cfg.model
    # The input embedding is a lookup, not a matmul (unless it doubles as the head).
    lookup = 0 if m.tie_embeddings else m.vocab_size * m.embed_dim
    attention = 12 * m.num_layers * m.num_heads * m.head_dim * cfg.seq_len
    return 6 * (num_params - lookup) + attention


def maxtext_flops_per_token(cfg) -> float:
    """Training FLOPs per token as MaxText counts them (calculate_tflops_training_per_device):
    3 x 2 per weight of the matmuls (SwiGLU's three, q/k/v/o, the output head once; no
    norms, biases or input lookup) plus attention with its causal half skipped."""
    m = cfg.model
    per_layer = 3 * m.embed_dim * m.mlp_dim + m.embed_dim * (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim
    weights = m.num_layers * per_layer + m.vocab_size * m.embed_dim
    causal_attention = 6 * m.num_layers * m.num_heads * m.head_dim * cfg.seq_len  # 12 L H d S / 2
    return 6 * weights + causal_attention


def peak_memory_gib(devices) -> float | None:
    """The most bytes any of `devices` has held at once since the process started
    (jax's memory_stats "peak_bytes_in_use"), in GiB; None where the platform does not
    report it (CPU)."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) / 2**30 if peaks else None


HOST_CPUS_VARIABLE = "HETJAX_HOST_CPUS"  # the cores launch.local shared out among its CPU processes


def measure_cpu_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an fp32 matmul on this host: the CPU stand-in for a peak table."""
    device = jax.local_devices()[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def peak_flops(cfg, devices) -> tuple[float, str]:
    """Total peak FLOP/s of `devices`, and where the figure came from."""
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops * 1e12 * len(devices), "config.peak_tflops"
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        # Virtual CPU devices share the host's cores: the host rate is the whole peak. A
        # process that launch.local pinned to a share of them measures that share: scaled
        # up to the cores the launcher had.
        cores = int(os.environ.get(HOST_CPUS_VARIABLE) or 0)
        if cores and cores > (mine := len(os.sched_getaffinity(0))):  # Linux only, as launch.local's pinning
            return (measure_cpu_matmul_flops() * cores / mine,
                    f"measured fp32 matmul on {mine} of this host's {cores} cores, x {cores}/{mine}")
        return measure_cpu_matmul_flops(), "measured fp32 matmul on this host"
    hw = hardware.for_device_kind(kind)
    if hw is not None:
        return hw.peak_flops * len(devices), f"{hw.name} bf16 data sheet"
    return math.nan, f"unknown device kind {kind!r}: set config.peak_tflops"


WANDB_MODES = ("", "online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (`pip install 'hetjax[wandb]'`): off while `project` is empty."""

    project: str = ""  # e.g. --config.wandb.project=hetjax: one W&B run per job
    entity: str = ""  # team or user; "": wandb's default
    name: str = ""  # the run's name; "": config.name
    group: str = ""  # groups a job's runs (an islands job's other processes); "": the run's name
    mode: str = ""  # online | offline | disabled; "": WANDB_MODE, else online


# wandb's own modes (its Settings.mode); those that talk to the server need a login.
WANDB_ENV_MODES = ("online", "offline", "shared", "disabled", "dryrun", "run")
WANDB_ONLINE = ("online", "shared", "run")
WANDB_PROJECT_BAD = "/\\#?%:"  # characters W&B refuses in a project name


def validate_wandb(w: WandbConfig) -> None:
    """Checks the section; with a project set, that wandb is installed and, for a run that
    talks to the server, logged in (before compiling: wandb would stop the run at its start)."""
    if w.mode not in WANDB_MODES:
        raise ConfigError(f"config.wandb.mode={w.mode!r}: use one of {', '.join(repr(m) for m in WANDB_MODES)}")
    if not w.project:
        if given := [f"config.wandb.{k}={getattr(w, k)!r}" for k in ("entity", "name", "group", "mode") if getattr(w, k)]:
            raise ConfigError(f"{', '.join(given)} without config.wandb.project: W&B is off until a project is "
                              f"set; add --config.wandb.project=NAME")
        return
    if bad := sorted({c for c in w.project if c in WANDB_PROJECT_BAD}):
        raise ConfigError(f"config.wandb.project={w.project!r}: W&B refuses {' '.join(bad)} in a project name; "
                          f"give the team or user as config.wandb.entity and the project alone "
                          f"(e.g. --config.wandb.entity=myteam --config.wandb.project=hetjax)")
    cli.need("wandb", "wandb", f"config.wandb.project={w.project!r}")
    mode, source = _wandb_mode(w)
    if mode not in WANDB_ENV_MODES:
        raise ConfigError(f"{source}={mode!r} is not a W&B mode: use one of {', '.join(WANDB_ENV_MODES)} "
                          f"(or leave it unset for online)")
    if mode in WANDB_ONLINE and not _wandb_logged_in():
        raise ConfigError(
            f"config.wandb.project={w.project!r}: this machine is not logged in to W&B (no "
            f"WANDB_API_KEY, no entry in ~/.netrc); run `wandb login`, or log without a network "
            f"with --config.wandb.mode=offline (or WANDB_MODE=offline) and `wandb sync` later")


def _wandb_mode(w: WandbConfig) -> tuple[str, str]:
    """(mode, where it was set) as wandb resolves it: the config, else WANDB_MODE, else the
    mode `wandb offline` keeps in ./wandb/settings, else the one in wandb's settings file
    (WANDB_CONFIG_DIR or ~/.config/wandb), else online."""
    if w.mode:
        return w.mode, "config.wandb.mode"
    if "WANDB_MODE" in os.environ:
        return os.environ["WANDB_MODE"], "WANDB_MODE"
    for path in (os.path.join("wandb", "settings"), _wandb_settings_file()):
        mode = _wandb_setting(path, "mode")
        if mode is not None:
            return mode, f"mode in {path}"
    return "online", "the default mode"


def _wandb_settings_file() -> str:
    """wandb's own settings file (where `wandb login --host` keeps the server)."""
    folder = os.environ.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
    return os.path.join(folder, "settings")


def _wandb_setting(path: str, key: str) -> str | None:
    """`key` of the [default] section of one of wandb's settings files, or None."""
    import configparser
    settings = configparser.ConfigParser()
    try:
        settings.read(path)
    except configparser.Error:
        return None
    return settings.get("default", key, fallback=None)


def _wandb_logged_in() -> bool:
    """Whether wandb will find a key: WANDB_API_KEY, or ~/.netrc's entry for the server,
    which `wandb login` keys by host and port; the server is WANDB_BASE_URL, else the one
    `wandb login --host` kept in wandb's settings file, else wandb's default."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse
    url, default = os.environ.get("WANDB_BASE_URL"), _wandb_default_url()
    if not url:
        url = _wandb_setting(_wandb_settings_file(), "base_url") or default
    parsed = urlparse(url)
    hosts = [parsed.netloc, parsed.hostname]
    if url == default:  # wandb falls back to the upstream server's key (wandb 0.31's forge)
        hosts.append("api.wandb.ai")
    try:
        entries = netrc.netrc(os.environ.get("NETRC"))
    except (OSError, netrc.NetrcParseError):
        return False
    return any(entries.authenticators(h) is not None for h in hosts if h)


def _wandb_default_url() -> str:
    """wandb's own default server (it changed from api.wandb.ai in wandb 0.31)."""
    try:
        from wandb.sdk.lib import urls
        return urls.DEFAULT_BASE_URL
    except (ImportError, AttributeError):
        return "https://api.wandb.ai"


class WandbRun:
    """Mirrors metrics.jsonl into one W&B run, with the resolved config attached. A run
    restarted in the same run_dir continues the same W&B run (its id is in
    run_dir/wandb_run_id); rows are keyed by their `step`, so a resumed run's repeated
    steps are logged again rather than dropped."""

    def __init__(self, w: WandbConfig, run_dir: Path, config: dict, suffix: str = ""):
        wandb = cli.need("wandb", "wandb", f"config.wandb.project={w.project!r}")
        id_file = run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id + "\n")
        name = (w.name or config.get("name", "hetjax")) + suffix
        self.run = wandb.init(project=w.project, entity=w.entity or None, name=name, id=run_id,
                              group=w.group or (w.name or config.get("name", "hetjax")),
                              job_type="island" if suffix else "train", mode=w.mode or None,
                              dir=str(run_dir), config=config, resume="allow")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: dict) -> None:
        self.run.log({"step": step, **scalars})

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)  # a crashed run shows as failed


def start_wandb(w: WandbConfig, run_dir: Path, config: dict, writes: bool | None) -> WandbRun | None:
    """The W&B run of this process, or None. `writes` is the job's writes_fingerprints:
    None on one mesh, where process 0 logs for all (the others log the same losses);
    with islands, the process that writes run_dir logs the job's run and every other
    process its own island's series, as a run in the same group."""
    if not w.project:
        return None
    if writes is None:
        return WandbRun(w, run_dir, config) if jax.process_index() == 0 else None
    return WandbRun(w, run_dir, config, "" if writes else f"/{run_dir.name}")


BAR_KEYS = ("loss", "eval_loss", "mfu")  # the progress bar's postfix: 80 columns hold these


_TENSORBOARD_IMPORT = threading.Lock()


def summary_writer():
    """tensorboardX's SummaryWriter, imported without PyTorch. tensorboardX imports torch
    whenever it is installed (the tests' extras install it for Hugging Face), which cost
    each training process 4 s for scalars that need only numpy."""
    with _TENSORBOARD_IMPORT:
        if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
            sys.modules.setdefault("torch", None)  # `import torch` raises ImportError while this stands
            try:
                import tensorboardX  # noqa: F401
            finally:
                if "torch" in sys.modules and sys.modules["torch"] is None:  # ours, never a torch another thread loaded
                    del sys.modules["torch"]
        from tensorboardX import SummaryWriter
        return SummaryWriter


class Writer:
    """Writes each step's scalars to metrics.jsonl and TensorBoard; shows progress."""

    def __init__(self, run_dir: Path, total_steps: int, tensorboard: bool = True, wandb: WandbRun | None = None,
                 start_step: int = 0):
        """start_step: where a resumed run goes on; TensorBoard drops its earlier events from
        there on, as truncate() does for metrics.jsonl, so re-run steps do not show twice."""
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.wandb = wandb
        self.tb = None
        if tensorboard:
            SummaryWriter = summary_writer()
            self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step)  # 0 too: a rerun from scratch
            from tensorboardX.proto.summary_pb2 import Summary  # after summary_writer(): no torch
            from tensorboardX.summary import scalar
            self._summary, self._tags = (Summary, scalar), {}
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def write(self, step: int, scalars: dict, echo: bool = False) -> None:
        scalars = {k: float(v) for k, v in scalars.items()}
        self.jsonl.write(json.dumps({"step": step, **scalars}) + "\n")
        if self.tb is not None:
            # One event per step holding every scalar, its values made here: add_scalar makes
            # an event each (2.3 ms a step for 25 scalars on the loop's thread), and
            # tensorboardX's scalar() cleans the same tag again each time (0.38 ms a step).
            Summary, scalar = self._summary
            tags = self._tags
            for k in scalars.keys() - tags.keys():
                tags[k] = scalar(k, 0.0).value[0].tag
            merged = Summary(value=[Summary.Value(tag=tags[k], simple_value=v) for k, v in scalars.items()])
            self.tb.file_writer.add_summary(merged, step)
        if self.wandb is not None:
            self.wandb.log(step, scalars)
        first = sorted(scalars, key=lambda k: k not in ("loss", "eval_loss"))  # the loss leads
        text = " ".join(f"{k}={scalars[k]:.4g}" for k in first) if echo else ""
        if self.bar is not None:
            # The bar keeps to what fits 80 columns; the full line of every log_every-th
            # step goes above it, into the terminal's scrollback.
            self.bar.n = step + 1
            self.bar.set_postfix_str(" ".join(f"{k}={scalars[k]:.4g}" for k in first if k in BAR_KEYS),
                                     refresh=True)
            if echo:
                self.bar.write(f"step {step}: {text}", file=sys.stderr)
        elif echo:
            print(f"step {step}: {text}", flush=True)

    def close(self, timeout_s: float = 10.0, failed: bool = False) -> None:
        """Closes the files; never blocks for more than `timeout_s`: tensorboardX's close
        joins its event thread, which a signal landing inside its queue can leave stuck.
        failed: the run ends on an error (W&B marks it failed)."""
        self.jsonl.close()
        if self.tb is not None:
            closer = threading.Thread(target=self.tb.close, daemon=True, name="hetjax-tensorboard-close")
            closer.start()
            closer.join(timeout_s)
            if closer.is_alive():
                print(f"warning: TensorBoard's writer did not close in {timeout_s:g}s; its last events "
                      f"may be missing (metrics.jsonl is complete)", file=sys.stderr, flush=True)
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.close(failed)


def check_finite(values: dict, s: int, last_finite: int) -> None:
    """Raises TrainingDiverged when step s's loss or gradient norm is not finite. A gradient
    norm that is not finite makes the update, and so the state after step s, not finite:
    caught here, before the save that follows step s (which reads these metrics first)."""
    for key, what in (("loss", "the loss"), ("grad_norm", "the gradient norm (so the parameters after it are not)")):
        if not np.isfinite(values[key]):
            raise TrainingDiverged(
                f"{what} is {values[key]} at step {s}; the last finite loss was at step {last_finite}, "
                f"so training diverged in steps {last_finite + 1}..{s}. Lower config.optim.learning_rate "
                f"or config.optim.grad_clip_norm")


def truncate(run_dir: Path, start: int, name: str = "metrics.jsonl") -> None:
    """Prepares metrics.jsonl (or another per-step JSONL file) for a run resumed at step `start`.

    Rows of steps >= start (written after the checkpoint, before the process died)
    will be computed again, bit for bit, so they move to metrics.superseded.jsonl,
    as does a torn last line; every row before `start` stays where it was.
    """
    path = run_dir / name
    if not path.exists():
        return
    keep, moved = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line)
            complete = line.endswith("\n")
        except json.JSONDecodeError:
            row, complete = None, False
        (keep if complete and row["step"] < start else moved).append(line if line.endswith("\n") else line + "\n")
    if moved:
        with open(path.with_suffix(".superseded.jsonl"), "a") as f:
            f.writelines(moved)
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(keep))
        tmp.replace(path)


class StepClock:
    """Each step's time, from the end of the one before (or of a pause: eval, the
    profiler starting) to its own end on the device. A thread waits on every step's
    metrics and notes when they are ready, so the time is right whether the platform
    dispatches asynchronously (the host runs ahead) or not (on CPU a program with
    collectives runs inside its call)."""

    def __init__(self):
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._done: dict[int, float] = {}
        self._resume: dict[int, float] = {}
        self._ready = threading.Condition()
        self._last = time.perf_counter()
        threading.Thread(target=self._watch, daemon=True, name="hetjax-step-clock").start()

    def dispatched(self, step: int, outputs) -> None:
        self._work.put((step, outputs))

    def resume(self, step: int) -> None:
        """Step `step` starts counting now at the earliest (after a pause)."""
        self._resume[step] = time.perf_counter()

    def seconds(self, step: int) -> float:
        """Step `step`'s time; steps are asked for in order."""
        with self._ready:
            self._ready.wait_for(lambda: step in self._done)
            done = self._done.pop(step)
        start = max(self._last, self._resume.pop(step, self._last))
        self._last = done
        return done - start

    def close(self) -> None:
        self._work.put(None)

    def _watch(self) -> None:
        while (item := self._work.get()) is not None:
            step, outputs = item
            try:
                jax.block_until_ready(outputs)
            except Exception:  # noqa: BLE001 - the step's own error reaches the loop when it reads them
                pass
            with self._ready:
                self._done[step] = time.perf_counter()
                self._ready.notify_all()
