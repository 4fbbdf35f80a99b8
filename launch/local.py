"""Starts a whole multi-island job on this machine and stops all of it if one process fails.

    python -m launch.local --config configs/X.py [--config.KEY=VALUE ...] [--stand_in cpu]
                           [--backend host|direct] [--pin auto|off]
                           [--module hetjax.hetero.linkcheck [--mib 64] [--iters 3]]
    python -m launch.local --config configs/tiny.py --processes 2 [--config.KEY=VALUE ...]

With --processes N, a config without islands runs as one jax.distributed world of N
processes over one mesh (each process holds mesh devices / N of it; N virtual devices in
all when the mesh has a -1 axis), as `srun -n N` runs it (launch/slurm/mesh.sbatch).
--backend sets every link's backend (config.hetero.link and each of config.hetero.links);
without it, a `local` link runs as `host` (processes cannot share one).

Every process of every island runs `python -m hetjax.train` (or --module's) with its
own environment: its island and rank, every process's host (all this machine) and the
job's first port (hetjax.hetero.scheduler's HETJAX_* variables, from which each process
derives its coordinator and transfer addresses exactly as on a SLURM or Kubernetes
cluster), and the devices it may use. Each output line is
echoed as `[island:rank] ...` and kept in run_dir/logs/<island>-<rank>.log. When a
process exits non-zero, the others get config.hetero.timeout_s to stop by themselves
(a dead peer makes them fail with their own timeout errors), then SIGTERM, then SIGKILL.
CPU processes (stand-ins) each get their own share of the cores (see cpu_shares; --pin off
to let them share all).
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from hetjax import cli as cli_lib  # `cli` below is the console entry point
from hetjax import config as config_lib, metrics
from hetjax.compile import backend
from hetjax.config import Config, ConfigError
from hetjax.hetero import config as hetero_config, runtime, scheduler
from hetjax.hetero.placement import proportional
from hetjax.stop import PREEMPTED

# On every process's path: the folder that holds the hetjax package (the repository in a
# checkout; installed, this file is hetjax/launch/local.py and its parent's parent is hetjax).
REPO = Path(config_lib.__file__).resolve().parent.parent
KILL_GRACE_S = 10.0  # after SIGTERM, before SIGKILL
STOPPED = (0, PREEMPTED, -signal.SIGTERM)  # a process on our SIGTERM: done, saved and exited, or killed
MODULES = ("hetjax.train", "hetjax.hetero.linkcheck")  # what every process may run (--module)
_VISIBLE = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}


def free_ports(count: int, span: int = 1, host: str = "127.0.0.1") -> list[int]:
    """`count` free base ports, each followed by span - 1 more free ones (base + k, k < span),
    below Linux's ephemeral range: the sockets are let go before the processes bind them,
    and a port the kernel hands to a connection (or to gloo's listeners) meanwhile is
    drawn from that range, never from ours."""
    ports: list[int] = []
    low, high = _ephemeral_range()
    if low - span > _LOWEST_PORT:
        bottom, top = _LOWEST_PORT, low - span
    elif high + 1 < 65536 - span:  # a range that starts low may leave room above it
        bottom, top = high + 1, 65536 - span
    else:
        raise ConfigError(f"the kernel's ephemeral ports ({low}-{high}, /proc/sys/net/ipv4/ip_local_port_range) "
                          f"leave no block of {span} ports outside them for the job's listeners; narrow them, "
                          f"e.g. sysctl net.ipv4.ip_local_port_range='32768 60999'")
    draw = random.Random()
    with ExitStack() as stack:  # hold every socket until all are chosen: no port twice
        def bind(port):
            s = stack.enter_context(socket.socket())
            s.bind((host, port))
            return s.getsockname()[1]
        for _ in range(1000):
            if len(ports) == count:
                return ports
            base = draw.randrange(bottom, top)
            try:
                for k in range(span):
                    bind(base + k)
            except OSError:
                continue  # taken: draw another base
            ports.append(base)
    raise ConfigError(f"no {count} block(s) of {span} free ports between {bottom} and {top + span} on "
                      f"{host}; free some")


_LOWEST_PORT = 10000


def _ephemeral_range() -> tuple[int, int]:
    """Linux's ephemeral port range (32768-60999 where it cannot be read)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def plan(cfg: Config, stand_in: str = "", host: str = "127.0.0.1") -> list[scheduler.Placement]:
    """Every process of the job, all on `host`, with a free block of ports for the job (the
    same block layout as on a cluster: hetero.scheduler.settings)."""
    islands = cfg.hetero.islands
    hosts = {i.name: (host,) * i.num_processes for i in islands}
    port = free_ports(1, scheduler.span(hosts, cfg), host)[0]
    return [scheduler.Placement("hetjax", i.name, rank, hosts, port, stand_in)
            for i in islands for rank in range(i.num_processes)]


def cpu_shares(devices: list[int], cores: list[int]) -> list[tuple[int, ...]] | None:
    """Disjoint sets of `cores` for processes with `devices` CPU devices each, in proportion
    to them (at least one core each); None when there are fewer cores than processes.

    Stand-in islands on one machine: two processes that each run XLA's threads on every
    core would share them badly (measured here on the tiny islands: 30.5k tokens/s
    unpinned against 39.6k with a core each), so each keeps to its own share of the cores
    (hetero.runtime.initialize), as separate machines would. The one-island comparison gets
    the same cores in all."""
    if len(cores) < len(devices) or not devices:
        return None
    counts = proportional(len(cores), devices, what="cores")
    starts = [sum(counts[:k]) for k in range(len(counts))]
    return [tuple(cores[a:a + n]) for a, n in zip(starts, counts)]


def process_env(placement: scheduler.Placement, island, first_device: int, base=None) -> dict[str, str]:
    """The environment of one process: where it runs (HETJAX_*), its platform and devices."""
    env = device_env(placement.stand_in or island.platform, island.devices_per_process, first_device, base)
    env.update(placement.to_env())
    return env


def device_env(platform: str, devices: int, first_device: int = 0, base=None) -> dict[str, str]:
    """An environment for `python -m hetjax...` from the repository on `devices` devices of
    `platform`: that many virtual devices on CPU, GPUs first_device.. otherwise."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the log as they are printed
    env["JAX_PLATFORMS"] = platform
    if platform == "cpu":
        env["XLA_FLAGS"] = backend.with_cpu_device_count(env.get("XLA_FLAGS", ""), devices)
    else:  # several processes of GPU islands on one machine: each takes its own of the GPUs given
        name = _VISIBLE[platform]
        given = [g.strip() for g in env.get(name, "").split(",") if g.strip()]
        if given and len(given) < first_device + devices:
            raise ConfigError(f"{name}={env[name]} gives this job {len(given)} GPUs, but its processes need at "
                              f"least {first_device + devices} of them; give more, or fewer devices_per_process")
        env[name] = ",".join(given[first_device:first_device + devices] if given
                             else map(str, range(first_device, first_device + devices)))
    return env


def job_config(config: str, overrides: dict[str, str] | None, backend: str | None,
               processes: int | None = None) -> tuple[Config, dict]:
    """The config every process runs, and the overrides that make it (virtual islands off).
    With `processes`, a config without islands, seen as one island `mesh` of that many
    processes (hetero.scheduler.one_island), which is how each process will place itself."""
    overrides = dict(overrides or {}, **{"hetero.virtual": "False"})
    cfg = config_lib.load(config, overrides)
    if processes is not None:
        return _mesh_job_config(config, cfg, processes, backend), overrides
    if not cfg.hetero.islands:
        raise ConfigError(f"--config={config!r} has no config.hetero.islands; launch.local starts "
                          f"multi-island jobs, or a one-mesh job over several processes with "
                          f"--processes N (run python -m hetjax.train for one process)")
    if backend or cfg.hetero.link.backend == "local":
        overrides["hetero.link.backend"] = backend or "host"
    cfg = dataclasses.replace(cfg, hetero=hetero_config.for_processes(cfg.hetero, backend))  # links: see run()
    config_lib.validate(cfg)
    return cfg, overrides


def _mesh_job_config(config: str, cfg: Config, processes: int, link_backend: str | None) -> Config:
    if cfg.hetero.islands:
        raise ConfigError(f"--processes={processes}: --config={config!r} has islands, and each island says "
                          f"its own num_processes; drop --processes")
    if link_backend:
        raise ConfigError(f"--backend={link_backend}: a one-mesh job has no links between islands; drop it")
    if processes < 1:
        raise ConfigError(f"--processes={processes}: give at least 1")
    config_lib.validate(cfg)
    try:  # a -1 axis: one device per process, the mesh as large as the processes
        per = scheduler.mesh_devices_per_process(cfg, processes) or 1
    except ConfigError as e:
        raise ConfigError(f"--processes={processes}: {e}") from None
    platform = backend.resolve(cfg.compile)[0].platform
    return scheduler.one_island(cfg, processes, per, platform)


def secret_env(cfg: Config, environ=None) -> dict[str, str]:
    """The job's transfer secret: the user's if set, else a fresh random one for this job."""
    environ = os.environ if environ is None else environ
    out = {}
    for link in cfg.hetero.links or (cfg.hetero.link,):
        if not link.secret_file and not environ.get(link.secret_env):
            out.setdefault(link.secret_env, secrets.token_hex(32))
    return out


@dataclasses.dataclass
class Process:
    settings: runtime.ProcessSettings
    popen: subprocess.Popen
    reader: threading.Thread | None


def _pump(stream, prefix: str, log_path: Path, out, lock, on_line) -> None:
    """Copies a process's output to its log and, prefixed, to `out`. The pipe is read to
    its end whatever happens to `out` (a closed terminal, `| head`) or the hook: a process
    whose pipe fills up blocks for ever, and the job with it."""
    with open(log_path, "a", buffering=1) as log:  # a rerun in the same run_dir keeps the last one's log
        log.write(f"----- launch.local: this process started at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        for line in iter(stream.readline, ""):
            log.write(line)
            if out is not None:
                try:
                    with lock:
                        out.write(prefix + line)
                        out.flush()
                except (OSError, ValueError) as e:  # the echo is gone; the log stays
                    log.write(f"----- launch.local: stopped echoing this output ({e!r})\n")
                    out = None
            if on_line is not None:
                try:
                    on_line(line)
                except Exception as e:  # noqa: BLE001 - a hook's error must not stop the reading
                    log.write(f"----- launch.local: the on_line hook failed and is off ({e!r})\n")
                    on_line = None
    stream.close()


def _signal_group(proc: subprocess.Popen, sig) -> None:
    try:
        os.killpg(proc.pid, sig)  # the process and its children (grain workers)
    except ProcessLookupError:
        pass


def run(config: str, overrides: dict[str, str] | None = None, *, stand_in: str = "",
        backend: str | None = None, timeout_s: float | None = None, command: list[str] | None = None,
        island_overrides: dict[str, dict[str, str]] | None = None, out=None, on_line=None,
        pin: str = "auto", processes: int | None = None) -> int:
    """Runs the job to its end; returns 0, or the exit status of the first process that failed.

    pin: "auto" gives each CPU process its own share of this machine's cores (cpu_shares,
    HETJAX_CPUS) when there are enough of them; "off" leaves scheduling to the OS.

    command: what each process runs before `--config ...` (default: python -m hetjax.train).
    island_overrides: extra --config.KEY=VALUE for one island's processes (to test that
    islands with different configs refuse to start).
    on_line(process, line): called with each output line of each Process (a watchdog's hook).
    processes: run a config without islands as one jax.distributed world of that many processes.
    """
    out = sys.stdout if out is None else out
    if pin not in ("auto", "off"):
        raise ConfigError(f"--pin={pin!r}: choose auto (a share of the cores per CPU process) or off")
    cfg, overrides = job_config(config, overrides, backend, processes)
    timeout_s = cfg.hetero.timeout_s if timeout_s is None else timeout_s
    islands = {i.name: i for i in cfg.hetero.islands}
    unknown = set(island_overrides or {}) - set(islands)
    if unknown:
        raise ConfigError(f"island_overrides names {sorted(unknown)}, not islands of config.hetero.islands "
                          f"({', '.join(islands)})")
    _check_platforms(cfg, stand_in)
    command = [sys.executable, "-m", "hetjax.train"] if command is None else list(command)
    logs = Path(cfg.run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if cfg.hetero.links:  # no --config.KEY=VALUE reaches a LinkConfig in a tuple: a config file sets them
        config = hetero_config.write_links_config(logs / "links_config.py", config_lib.find_config_file(config),
                                                  cfg.hetero.links)
    shared = dict(os.environ, **secret_env(cfg), **{runtime.LAUNCHER_VARIABLE: str(os.getpid())})
    if processes is not None:
        shared[scheduler.NUM_PROCESSES] = str(processes)
    lock, procs, next_device = threading.Lock(), [], {}

    def say(text):
        try:
            with lock:
                out.write(f"[launch] {text}\n")
                out.flush()
        except (OSError, ValueError):  # a closed terminal or pipe: the job goes on, and is stopped as it should
            pass

    stop = []  # a signal asked the launcher to stop the job
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        # A closed terminal or ssh session (SIGHUP) stops the job as Ctrl-C does: the
        # processes run in their own sessions and would not get it.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            handlers[sig] = signal.signal(sig, lambda s, _: stop.append(s))
    try:
        placements = plan(cfg, stand_in)
        derived = [scheduler.settings(p, cfg) for p in placements]  # as each process will derive them
        cpus = [s.platform(islands[s.island]) == "cpu" for s in derived]
        shares = iter(cpu_shares([islands[s.island].devices_per_process for s, c in zip(derived, cpus) if c],
                                 sorted(os.sched_getaffinity(0))) or () if pin == "auto" else ())
        for placement, s, cpu in zip(placements, derived, cpus):
            island = islands[s.island]
            first = next_device.get(s.platform(island), 0)
            next_device[s.platform(island)] = first + island.devices_per_process
            args = [f"--config.{k}={v}" for k, v in {**overrides, **(island_overrides or {}).get(s.island, {})}.items()]
            env = process_env(placement, island, first, shared)
            share = next(shares, None) if cpu else None
            if share:
                env[runtime.CPUS_VARIABLE] = ",".join(map(str, share))
                env[metrics.HOST_CPUS_VARIABLE] = str(len(os.sched_getaffinity(0)))  # the MFU's whole peak
            popen = subprocess.Popen(command + ["--config", config] + args, cwd=os.getcwd(),
                                     env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     start_new_session=True)
            proc = Process(s, popen, None)
            hook = None if on_line is None else lambda line, proc=proc: on_line(proc, line)
            proc.reader = threading.Thread(target=_pump, daemon=True, args=(
                popen.stdout, f"[{s.tag}] ", logs / f"{s.island}-{s.process_id}.log", out, lock, hook))
            proc.reader.start()
            procs.append(proc)
        say(f"started {len(procs)} processes of islands {', '.join(islands)}; logs in {logs}")
        status = _supervise(procs, timeout_s, stop, say)
    finally:
        for p in procs:  # whatever happened above, no process (nor a child of one) outlives the launcher
            _signal_group(p.popen, signal.SIGKILL)
            p.popen.wait()
        for p in procs:
            p.reader.join(timeout=5)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return status


def _check_platforms(cfg: Config, stand_in: str) -> None:
    """One ConfigError before any process starts, instead of a JAX traceback per island,
    when an island's platform cannot start here."""
    plugins = backend.installed_plugins()
    for k, island in enumerate(cfg.hetero.islands):
        why = backend.unavailable(stand_in or island.platform, plugins)
        if why:
            raise ConfigError(
                f"config.hetero.islands[{k}] ({island.name}) runs on platform {island.platform!r}, but "
                f"{why} on this machine; run it elsewhere, or try the job here with CPU stand-ins: "
                f"--stand_in cpu")


def _supervise(procs: list[Process], timeout_s: float, stop: list, say) -> int:
    """Waits for the job; on the first failure (or a signal to the launcher) stops the rest."""
    failed, deadline, seen, stopping = None, None, set(), False

    def look():
        nonlocal failed, deadline
        for p in procs:
            code = p.popen.poll()
            if code is None or p.settings.tag in seen:
                continue
            seen.add(p.settings.tag)
            if failed is None and code and not stopping:
                failed = (p, code)
                say(f"island {p.settings.island} rank {p.settings.process_id} exited with "
                    f"{_status(code)}; the other processes get {timeout_s:g}s to stop")
                deadline = time.monotonic() + timeout_s
            elif stopping and failed is None and code not in STOPPED:
                failed = (p, code)  # a failed save, a crash: not to be taken for a clean stop
                say(f"island {p.settings.island} rank {p.settings.process_id} exited with {_status(code)} while "
                    f"stopping (not 0, {PREEMPTED} or signal 15); its last checkpoint may be missing")
            elif stopping:
                say(f"{p.settings.tag} stopped with {_status(code)}")
            elif failed is not None:
                say(f"{p.settings.tag} stopped by itself with {_status(code)}")

    while any(p.popen.poll() is None for p in procs):
        look()
        if stop and not stopping:  # after a failure too: the user wants it over now
            stopping = True
            say(f"got signal {stop[0]}: stopping the job (SIGTERM to every process; a second signal kills)")
            for p in procs:
                _signal_group(p.popen, signal.SIGTERM)
            deadline = min(deadline or math.inf, time.monotonic() + timeout_s)
        if len(stop) > 1:
            say(f"got signal {stop[1]} too: SIGKILL to every process")
            for p in procs:
                _signal_group(p.popen, signal.SIGKILL)
            seen.update(p.settings.tag for p in procs)
            break
        if deadline is not None and time.monotonic() > deadline:
            _terminate(procs, say)
            seen.update(p.settings.tag for p in procs)
            break
        time.sleep(0.05)
    look()
    if failed is not None:
        p, code = failed
        status = code if code > 0 else 128 - code
        # After a stop signal, a failure must not read as the clean stop's 128 + signal.
        return 1 if stop and status == 128 + stop[0] else status
    return 128 + stop[0] if stop else 0


def _status(code: int) -> str:
    return f"signal {-code}" if code < 0 else str(code)


def _terminate(procs: list[Process], say) -> None:
    alive = [p for p in procs if p.popen.poll() is None]
    say(f"still running after the timeout: {', '.join(p.settings.tag for p in alive)}; SIGTERM")
    for p in alive:
        _signal_group(p.popen, signal.SIGTERM)
    deadline = time.monotonic() + KILL_GRACE_S
    while any(p.popen.poll() is None for p in alive) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in alive:
        if p.popen.poll() is None:
            say(f"{p.settings.tag} ignored SIGTERM; SIGKILL")
            _signal_group(p.popen, signal.SIGKILL)
            p.popen.wait()


def main(argv: list[str] | None = None) -> int:
    args = cli_lib.parse_command_line(sys.argv[1:] if argv is None else argv, flags=(), doc=__doc__,
                                      options={"stand_in": "", "backend": None, "module": "hetjax.train",
                                               "pin": "auto", "processes": None, "mib": None, "iters": None})
    options = args.options
    # The link check's own options, for each of its processes (as hetjob.sbatch's "$@").
    check = [f"--{k}={v}" for k, v in {k: options.pop(k) for k in ("mib", "iters")}.items() if v is not None]
    if options["stand_in"] not in ("",) + config_lib.PLATFORMS:
        raise ConfigError(f"--stand_in={options['stand_in']!r}: choose one of {config_lib.PLATFORMS}")
    if options["backend"] not in (None, "host", "direct"):
        raise ConfigError(f"--backend={options['backend']!r}: choose host or direct")
    if options["module"] not in MODULES:
        raise ConfigError(f"--module={options['module']!r}: choose one of {MODULES}")
    if check and options["module"] != "hetjax.hetero.linkcheck":
        raise ConfigError(f"{' '.join(check)}: the link check's options; add --module hetjax.hetero.linkcheck")
    if options["processes"] is not None:
        text = options["processes"]
        if not str(text).isdigit() or int(text) < 1:
            raise ConfigError(f"--processes={text!r}: give a number of processes, e.g. --processes 2")
        options["processes"] = int(text)
    command = [sys.executable, "-m", options.pop("module"), *check]
    return run(args.config, args.overrides, command=command, **options)


def cli() -> int:
    return cli_lib.run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
