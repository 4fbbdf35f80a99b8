"""launch.local and hetero.runtime: settings through the environment, and a job of
dummy processes (no jax) that is prefixed, logged, and stopped as a whole when one fails."""

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hetjax.compile import backend
from hetjax.errors import ConfigError
from hetjax.hetero import runtime, scheduler
from hetjax.launch import local

ROOT = Path(__file__).resolve().parent.parent

CONFIG = """
from hetjax.config import Config, HeteroConfig, IslandConfig, MeshConfig, ModelConfig

def get_config():
    return Config(model=ModelConfig(num_layers=3), steps=4, batch_size=16, seq_len=16,
                  run_dir={run_dir!r}, hetero=HeteroConfig(islands=(
                      IslandConfig(name="a", num_processes=2, devices_per_process=2),
                      IslandConfig(name="b", platform="rocm", num_processes=1, devices_per_process=2)),
                      timeout_s=1.0))
"""


@pytest.fixture
def cfg_path(tmp_path):
    path = tmp_path / "islands.py"
    path.write_text(CONFIG.format(run_dir=str(tmp_path / "run")))
    return str(path)


def settings_of(cfg):
    return {s.tag: s for s in (scheduler.settings(p, cfg) for p in local.plan(cfg, stand_in="cpu"))}


def env_of(cfg, tag):
    return next(p.to_env() for p in local.plan(cfg, stand_in="cpu") if f"{p.island}:{p.rank}" == tag)


def test_plan_gives_distinct_ports_and_the_processes_derive_the_launchers_settings(cfg_path):
    cfg, _ = local.job_config(cfg_path, {"hetero.placement": "pipeline"}, "host")
    assert cfg.hetero.virtual is False and cfg.hetero.link.backend == "host"
    plan = settings_of(cfg)
    assert sorted(plan) == ["a:0", "a:1", "b:0"]
    assert plan["a:0"].coordinator == plan["a:1"].coordinator != plan["b:0"].coordinator
    # 2 islands: 1 link, and the processes' base ports differ.
    ports = [runtime.link_address(plan["a:0"], i, p, 0) for i, n in (("a", 2), ("b", 1)) for p in range(n)]
    assert len(set(ports)) == 3 and all(a.startswith("127.0.0.1:") for a in ports)
    for placement in local.plan(cfg, stand_in="cpu"):
        env = placement.to_env()
        assert all(isinstance(v, str) for v in env.values())
        assert scheduler.placement_from_env(env, cfg) == placement
        mine = scheduler.from_env(env, cfg)
        # One host: blocks of 2 ports (coordinator, the link) from P for a:0, a:1, b:0.
        p, h = placement.port, "127.0.0.1"
        assert (mine.tag, mine.stand_in, mine.source) == (f"{placement.island}:{placement.rank}", "cpu", "hetjax")
        assert mine.coordinator == {"a": f"{h}:{p}", "b": f"{h}:{p + 4}"}[mine.island]
        assert mine.transfer == {"a": (f"{h}:{p + 1}", f"{h}:{p + 3}"), "b": (f"{h}:{p + 5}",)}
    assert scheduler.from_env({}, cfg) is None


def test_link_addresses_leave_room_for_every_link(tmp_path):
    text = CONFIG.replace('devices_per_process=2)),', 'devices_per_process=2),\n'
                          '                      IslandConfig(name="c")),')
    path = tmp_path / "three.py"
    path.write_text(text.format(run_dir=str(tmp_path / "run")))
    cfg, _ = local.job_config(str(path), {}, None)
    assert runtime.num_links(cfg) == 3 and cfg.hetero.link.backend == "host"  # a-b, b-c, a-c
    s = scheduler.settings(local.plan(cfg)[0], cfg)
    used = [runtime.link_address(s, i.name, p, k) for i in cfg.hetero.islands
            for p in range(i.num_processes) for k in range(3)]
    assert len(set(used)) == len(used) == 12  # (2 + 1 + 1) processes x 3 links, no port twice
    host, port = runtime.split_address(runtime.link_address(s, "b", 0, 2))
    assert (host, port - 2) == runtime.split_address(s.transfer["b"][0])


LINKS = CONFIG.replace("ModelConfig\n", "ModelConfig, LinkConfig\n").replace(
    "timeout_s=1.0))", "timeout_s=1.0, links=(LinkConfig(backend='local', streams=4),)))")
# A process's view of its config: loaded and checked as hetjax.train does.
LINKS_SEEN = textwrap.dedent("""
    import sys
    from hetjax import cli, config
    args = cli.parse_command_line(sys.argv[1:])
    cfg = config.load(args.config, args.overrides)
    config.validate(cfg)
    print("links", [(link.backend, link.streams) for link in cfg.hetero.links], flush=True)
""")


def test_per_pair_links_of_virtual_islands_run_as_processes(tmp_path):
    """config.hetero.links' `local` entries were left as they were, so every process refused
    them (`links[0].backend='local' with virtual=False`), and --backend was refused."""
    path = tmp_path / "links.py"
    path.write_text(LINKS.format(run_dir=str(tmp_path / "run")))
    cfg, _ = local.job_config(str(path), {}, None)
    assert [(link.backend, link.streams) for link in cfg.hetero.links] == [("host", 4)]
    cfg, _ = local.job_config(str(path), {}, "direct")  # --backend sets every link
    assert (cfg.hetero.link.backend, cfg.hetero.links[0].backend) == ("direct", "direct")
    out = io.StringIO()
    code = local.run(str(path), stand_in="cpu", command=[sys.executable, "-c", LINKS_SEEN], out=out)
    assert code == 0, out.getvalue()
    assert "[b:0] links [('host', 4)]" in out.getvalue().splitlines(), out.getvalue()


@pytest.mark.parametrize("change, names", [
    ({scheduler.ISLAND: "z"}, ["HETJAX_ISLAND", "'z'", "a, b"]),
    ({scheduler.PROCESS_ID: "2"}, ["HETJAX_PROCESS_ID", "'2'", "0..1"]),
    ({scheduler.PROCESS_ID: "x"}, ["HETJAX_PROCESS_ID", "'x'"]),
    ({scheduler.HOSTS: "[1"}, ["HETJAX_HOSTS", "JSON"]),
    ({scheduler.HOSTS: json.dumps({"a": ["h", "h"]})}, ["HETJAX_HOSTS", "every island"]),
    ({scheduler.HOSTS: json.dumps({"a": ["h"], "b": ["h"]})}, ["island 'a'", "2 process"]),
    ({scheduler.HOSTS: json.dumps({"a": ["h", ""], "b": ["h"]})}, ["island 'a'", "one host"]),
    ({scheduler.PORT: "0"}, ["HETJAX_PORT", "'0'", "first port"]),
    ({scheduler.PORT: "65534"}, ["HETJAX_PORT=65534", "65534..65539", "at most 65530"]),
    ({scheduler.STAND_IN: "gpu"}, ["HETJAX_STAND_IN", "'gpu'"]),
])
def test_bad_environment_is_a_named_config_error(cfg_path, change, names):
    cfg, _ = local.job_config(cfg_path, {}, None)
    env = dict(env_of(cfg, "a:1"), **change)
    with pytest.raises(ConfigError) as e:
        scheduler.from_env(env, cfg)
    for name in names:
        assert name in str(e.value)


def test_jax_is_told_to_take_the_settings_as_they_are():
    # jax's own SLURM detection would set local_device_ids=[SLURM_LOCALID]: one GPU of 8.
    assert runtime.distributed_kwargs(10.0)["cluster_detection_method"] == "deactivate"


def test_process_environment_gives_each_process_its_devices(cfg_path):
    cfg, _ = local.job_config(cfg_path, {}, None)
    a, b = cfg.hetero.islands
    s = {f"{p.island}:{p.rank}": p for p in local.plan(cfg, stand_in="cpu")}
    env = local.process_env(s["a:1"], a, 2, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --x=1"})
    assert env["XLA_FLAGS"] == "--x=1 --xla_force_host_platform_device_count=2" and env["JAX_PLATFORMS"] == "cpu"
    real = dataclasses.replace(s["b:0"], stand_in="")  # no stand-in: the island's ROCm
    env = local.process_env(real, b, 3, {})
    assert env["HIP_VISIBLE_DEVICES"] == "3,4" and env["JAX_PLATFORMS"] == "rocm"
    # The GPUs the launcher was given (a SLURM allocation, CUDA_VISIBLE_DEVICES=4,5,6,7): slices of them.
    env = local.process_env(real, b, 2, {"HIP_VISIBLE_DEVICES": "4,5,6,7"})
    assert env["HIP_VISIBLE_DEVICES"] == "6,7"
    with pytest.raises(ConfigError, match="HIP_VISIBLE_DEVICES=4,5 gives this job 2 GPUs, but its processes need "
                                          "at least 4"):
        local.process_env(real, b, 2, {"HIP_VISIBLE_DEVICES": "4,5"})


def test_the_job_s_ports_lie_outside_the_kernel_s_ephemeral_range(monkeypatch):
    low, high = local._ephemeral_range()
    assert 1024 < low <= high <= 65535
    for base in local.free_ports(5, span=4):
        assert local._LOWEST_PORT <= base and base + 4 <= low
    # A range that starts low leaves room above it (it raised a bare ValueError from randrange),
    # and one that takes every port is named.
    monkeypatch.setattr(local, "_ephemeral_range", lambda: (1024, 50000))
    assert all(50000 < base <= 65536 - 4 for base in local.free_ports(3, span=4))
    monkeypatch.setattr(local, "_ephemeral_range", lambda: (1024, 65535))
    with pytest.raises(ConfigError, match=r"ephemeral ports \(1024-65535, /proc/sys/net/ipv4/ip_local_port_range\)"):
        local.free_ports(1, span=4)


def test_bad_launcher_input_is_refused_before_anything_starts(cfg_path, tmp_path):
    with pytest.raises(ConfigError, match="no config.hetero.islands"):
        local.run("configs/tiny.py", {"run_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="config.hetero.timeout_s=-1"):
        local.run(cfg_path, {"hetero.timeout_s": "-1"})
    with pytest.raises(ConfigError, match="--stand_in='gpu'"):
        local.main(["--config", cfg_path, "--stand_in", "gpu"])
    with pytest.raises(ConfigError, match="--module='hetjax.convert'.*hetjax.hetero.linkcheck"):
        local.main(["--config", cfg_path, "--module=hetjax.convert"])
    with pytest.raises(ConfigError, match=r"\['q'\]"):
        local.run(cfg_path, island_overrides={"q": {"seed": "1"}})
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.skipif(not (backend.unavailable("cuda") and backend.unavailable("rocm")),
                    reason="this machine has a GPU platform of the islands")
def test_islands_on_missing_gpus_are_one_error_before_any_process_starts(tmp_path):
    # The command configs/tiny_hetero.py's docstring suggests, on a machine without its GPUs.
    proc = subprocess.run([sys.executable, "-m", "launch.local", "--config", "configs/tiny_hetero.py",
                           f"--config.run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert "runs on platform 'cuda', but no jax plugin for cuda is installed" in lines[0], lines
    assert "--stand_in cpu" in lines[0] and not (tmp_path / "run").exists()


# A dummy workload: reads its settings as hetjax.train would, prints on stdout and stderr;
# b:0 fails (exit 3) and a:1 ignores SIGTERM, so the launcher has to escalate to SIGKILL.
DUMMY = textwrap.dedent("""
    import os, signal, sys, time
    from hetjax import cli, config
    from hetjax.hetero import scheduler
    args = cli.parse_command_line(sys.argv[1:])
    s = scheduler.from_env(os.environ, config.load(args.config, args.overrides))
    print("hello from", s.tag, os.environ["XLA_FLAGS"].split()[-1], "seed", args.overrides.get("seed"), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if s.tag == "b:0" and os.environ.get("FAIL"):
        time.sleep(0.5)
        sys.exit(3)
    if s.tag == "a:1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.environ.get("FAIL"):
        time.sleep(60)
""")


def test_a_job_of_dummy_processes_runs_with_prefixed_output_and_log_files(cfg_path, tmp_path):
    out = io.StringIO()
    code = local.run(cfg_path, {"steps": "5"}, stand_in="cpu", command=[sys.executable, "-c", DUMMY],
                     island_overrides={"b": {"seed": "7"}}, out=out)
    assert code == 0, out.getvalue()
    lines = out.getvalue().splitlines()
    for tag, devices, seed in (("a:0", 2, None), ("a:1", 2, None), ("b:0", 2, "7")):
        want = f"[{tag}] hello from {tag} --xla_force_host_platform_device_count={devices} seed {seed}"
        assert want in lines
        assert f"[{tag}] to stderr" in lines
        log = (tmp_path / "run" / "logs" / f"{tag.replace(':', '-')}.log").read_text().splitlines()
        assert log[0].startswith("----- launch.local: this process started at ")
        assert sorted(log[1:]) == sorted([want.removeprefix(f"[{tag}] "), "to stderr"])


def test_one_failing_process_stops_the_whole_job_within_the_timeout(cfg_path, monkeypatch):
    monkeypatch.setenv("FAIL", "1")
    monkeypatch.setattr(local, "KILL_GRACE_S", 0.5)
    out = io.StringIO()
    t0 = time.monotonic()
    code = local.run(cfg_path, stand_in="cpu", command=[sys.executable, "-c", DUMMY], out=out)
    took = time.monotonic() - t0
    text = out.getvalue()
    assert code == 3, text
    assert "[launch] island b rank 0 exited with 3" in text
    assert "a:1 ignored SIGTERM; SIGKILL" in text
    assert took < 15, took  # start + 0.5 s + timeout_s=1 + grace 0.5, far below the sleepers' 60 s


# Each process starts a grandchild that would outlive it, prints its pid, and a:0 exits 3.
ORPHANS = textwrap.dedent("""
    import os, subprocess, sys, time
    from hetjax import cli, config
    from hetjax.hetero import scheduler
    args = cli.parse_command_line(sys.argv[1:])
    s = scheduler.from_env(os.environ, config.load(args.config, args.overrides))
    if os.environ.get("IGNORE_TERM"):
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    codes = dict(x.split("=") for x in os.environ.get("TERM_EXIT", "").split(",") if x)
    if s.tag in codes:  # how this process ends on SIGTERM (143: saved, as hetjax.train; 1: its save failed)
        import signal
        signal.signal(signal.SIGTERM, lambda *_: os._exit(int(codes[s.tag])))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print("grandchild", child.pid, flush=True)
    for i in range(int(os.environ.get("LINES", "0"))):
        print("line", i, flush=True)
    if s.tag == "a:0":
        time.sleep(0.5)
        sys.exit(3)
    time.sleep(300)
""")
QUIET_ORPHANS = ORPHANS.replace('if s.tag == "a:0":', 'if False:')  # no process fails


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return status not in ("Z", "X")  # a zombie (not yet reaped by init) is dead


def _grandchildren(text: str) -> list[int]:
    return [int(line.split()[-1]) for line in text.splitlines() if " grandchild " in line]


def test_no_grandchild_outlives_the_launcher_even_when_its_parent_exited_first(cfg_path):
    out = io.StringIO()
    code = local.run(cfg_path, stand_in="cpu", timeout_s=1.0, command=[sys.executable, "-c", ORPHANS], out=out)
    assert code == 3, out.getvalue()
    pids = _grandchildren(out.getvalue())
    assert len(pids) == 3, out.getvalue()
    time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)], out.getvalue()  # a:0's too, whose parent had exited


class _ClosedTerminal(io.StringIO):
    """An echo that breaks after a few lines, as `launch.local ... | head` does."""

    def write(self, text):
        if self.tell() > 300:
            raise BrokenPipeError(32, "Broken pipe")
        return super().write(text)


def test_a_broken_echo_or_hook_neither_hangs_the_job_nor_cuts_the_logs(cfg_path, tmp_path, monkeypatch):
    monkeypatch.setenv("LINES", "3000")  # far more than a pipe holds: an unread pipe would block the process
    def hook(proc, line):
        raise RuntimeError("a broken watchdog")
    t0 = time.monotonic()
    code = local.run(cfg_path, stand_in="cpu", timeout_s=1.0, command=[sys.executable, "-c", ORPHANS],
                     out=_ClosedTerminal(), on_line=hook)
    assert code == 3 and time.monotonic() - t0 < 30
    log = (tmp_path / "run" / "logs" / "a-0.log").read_text()
    assert "line 2999" in log and "stopped echoing this output (BrokenPipeError" in log
    assert "the on_line hook failed and is off (RuntimeError('a broken watchdog'))" in log


@pytest.mark.parametrize("signals,ignore", [((signal.SIGHUP,), ""), ((signal.SIGINT, signal.SIGINT), "1")])
def test_a_closed_terminal_stops_the_job_and_a_second_signal_kills_it(cfg_path, monkeypatch, signals, ignore):
    """SIGHUP (a closed ssh session) stops the job as SIGTERM does; a second signal does not
    wait for processes that ignore SIGTERM to time out."""
    monkeypatch.setenv("IGNORE_TERM", ignore)
    t0 = time.monotonic()
    status, text = _stopped_job(cfg_path, signals)
    assert status == 128 + signals[0], text
    assert time.monotonic() - t0 < 40, text  # not the 60 s the processes would be given
    assert f"got signal {signals[0]}: stopping the job" in text
    time.sleep(0.2)
    assert not [pid for pid in _grandchildren(text) if _alive(pid)], text


def test_a_process_that_fails_while_the_job_stops_is_not_a_clean_stop(cfg_path, monkeypatch):
    """A process that exits 1 on SIGTERM (its checkpoint failed to save) made the launcher
    return 143 as for a clean preemption; it is a failure, named, with its own status."""
    monkeypatch.setenv("TERM_EXIT", "a:0=143,a:1=1")  # b:0 is killed by the SIGTERM itself
    status, text = _stopped_job(cfg_path, (signal.SIGTERM,))
    assert status == 1, text
    assert "[launch] island a rank 1 exited with 1 while stopping" in text
    assert "a:0 stopped with 143" in text and "b:0 stopped with signal 15" in text, text


def _stopped_job(cfg_path, signals):
    """(status, output) of a job of QUIET_ORPHANS sent `signals` once every process runs."""
    out = io.StringIO()
    started, seen = threading.Event(), set()

    def hook(proc, line):
        if line.startswith("grandchild"):
            seen.add(proc.settings.tag)
            if len(seen) == 3:  # every process is past its SIGTERM setting
                started.set()

    def send():
        started.wait(60)
        for sig in signals:
            os.kill(os.getpid(), sig)
            time.sleep(0.5)

    sender = threading.Thread(target=send)
    sender.start()
    status = local.run(cfg_path, stand_in="cpu", timeout_s=60.0, command=[sys.executable, "-c", QUIET_ORPHANS],
                       out=out, on_line=hook)
    sender.join()
    return status, out.getvalue()


# A process that follows its launcher as hetjax.train does, then waits.
# Stopped, it prints (into a pipe that lost its reader with the launcher) before it "saves".
FOLLOWER = textwrap.dedent("""
    import os, signal, sys, time
    from hetjax.hetero import runtime
    runtime.follow_launcher()

    def stop(*_):
        for i in range(100):
            print("step", i, "x" * 1000, flush=True)
        print("saving", file=sys.stderr, flush=True)
        open(os.path.join(os.environ["SAVED"], str(os.getpid())), "w").close()
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
    print("follower", os.getpid(), "inherits", os.environ.get(runtime.LAUNCHER_VARIABLE), flush=True)
    time.sleep(300)
""")


def test_a_killed_launcher_takes_its_processes_with_it(cfg_path, tmp_path):
    """SIGKILL gives the launcher no chance to stop its processes: each one asked Linux to
    send it SIGTERM when the launcher dies, and saves. (Its first print after that raised
    BrokenPipeError, the launcher having read its output: no checkpoint was written.)"""
    script = (f"import sys; from hetjax.launch import local; "
              f"local.run({cfg_path!r}, stand_in='cpu', command=[sys.executable, '-c', {FOLLOWER!r}])")
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT), SAVED=str(tmp_path / "saved")))
    (tmp_path / "saved").mkdir()
    pids = []
    for line in launcher.stdout:
        if " follower " in line:
            assert line.split()[-1] == "None", line  # not passed on to the processes it starts
            pids.append(int(line.split()[2]))
            if len(pids) == 3:
                break
    assert all(_alive(pid) for pid in pids)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)]
    assert sorted(int(p.name) for p in (tmp_path / "saved").iterdir()) == sorted(pids)


# A jax workload: each island is a real jax.distributed world (gloo inside it) that sums
# a sharded array every step; with FAIL set, a:1 dies after step 1.
JAX_WORKLOAD = textwrap.dedent("""
    import os, signal, sys, time
    from hetjax import cli, config
    from hetjax.hetero import runtime, scheduler
    args = cli.parse_command_line(sys.argv[1:])
    cfg = config.load(args.config, args.overrides)
    s = scheduler.from_env(os.environ, cfg)
    island = {i.name: i for i in cfg.hetero.islands}[s.island]
    runtime.initialize(s, island, cfg.hetero.timeout_s)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as hetjax.train; jax's own handler waits
    import jax, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((jax.device_count(),), ("x",))
    local = np.arange(jax.local_device_count(), dtype=np.float32) + 10 * jax.process_index()
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("x")), local)
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
    for step in range(int(os.environ.get("STEPS", "2"))):
        print("step", step, "sum", float(total(x)), "of", jax.process_count(), flush=True)
        if s.tag == "a:1" and os.environ.get("FAIL") and step == 1:
            os._exit(1)
        time.sleep(0.2)
""")


def test_islands_are_separate_jax_distributed_worlds_with_gloo(cfg_path):
    out = io.StringIO()
    code = local.run(cfg_path, stand_in="cpu", timeout_s=30, command=[sys.executable, "-c", JAX_WORKLOAD], out=out)
    text = out.getvalue()
    assert code == 0, text
    # Island a: 2 processes x 2 devices holding [0, 1] and [10, 11]; island b alone: [0, 1].
    for tag, want in (("a:0", 22.0), ("a:1", 22.0), ("b:0", 1.0)):
        n = 2 if tag.startswith("a") else 1
        assert f"[{tag}] step 1 sum {want} of {n}" in text, text


def test_a_process_that_dies_stops_its_island_peer_by_heartbeat(cfg_path, monkeypatch):
    monkeypatch.setenv("FAIL", "1")
    monkeypatch.setenv("STEPS", "1000")
    out = io.StringIO()
    code = local.run(cfg_path, {"hetero.timeout_s": "6"}, stand_in="cpu",
                     command=[sys.executable, "-c", JAX_WORKLOAD], out=out)
    text = out.getvalue()
    assert code == 1 and "[launch] island a rank 1 exited with 1" in text, text
    assert "a:0 stopped by itself" in text, text  # jax's heartbeat, before the launcher's SIGTERM


def test_a_dead_coordinator_is_an_error_naming_the_island():
    port = local.free_ports(1)[0]  # nobody listens there
    code = textwrap.dedent(f"""
        from hetjax.config import IslandConfig
        from hetjax.hetero import runtime
        s = runtime.ProcessSettings("a", 1, 2, "127.0.0.1:{port}", {{"a": ("h:1", "h:2")}}, "cpu")
        try:
            runtime.initialize(s, IslandConfig(name="a", num_processes=2), timeout_s=1.0)
        except runtime.IslandStartError as e:
            print(e)
    """)
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONPATH=str(local.REPO), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert f"island a:1: the coordinator (process 0 of island 'a') at 127.0.0.1:{port} did not answer " \
           f"within 1s" in run.stdout, run.stdout + run.stderr
    assert time.monotonic() - t0 < 30


# An island process kept to one core (HETJAX_CPUS, as launch.local pins stand-ins) offers an
# array over `direct`, then runs a long program, as an island sends and goes on to its next
# operation.
KEPT_SENDER = textwrap.dedent("""
    import os, sys, time
    from hetjax.config import IslandConfig
    from hetjax.hetero import runtime
    core = int(os.environ["HETJAX_CPUS"])
    s = runtime.ProcessSettings("a", 0, 1, "127.0.0.1:" + sys.argv[1], {"a": ("127.0.0.1:1",)}, "cpu")
    runtime.initialize(s, IslandConfig(name="a"), timeout_s=30.0)
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import transfer
    server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
    work = jax.jit(lambda a, n: jax.lax.fori_loop(0, n, lambda i, b: jnp.tanh(b @ b), a))
    big = jnp.full((512, 512), 1 / 512, jnp.float32)
    jax.block_until_ready(work(big, 20))
    t = time.perf_counter()
    jax.block_until_ready(work(big, 20))
    n = max(20, int(20 * float(sys.argv[2]) / (time.perf_counter() - t)))  # a program of about argv[2] s
    def kept(thread):
        try:
            return os.sched_getaffinity(int(thread)) == {core}
        except ProcessLookupError:  # it ended meanwhile
            return True
    print("kept", all(map(kept, os.listdir("/proc/self/task"))), "address", server.address(), flush=True)
    sys.stdin.readline()
    x = jax.device_put(np.arange(64 * 128, dtype=np.float32).reshape(64, 128))
    server.await_pull(7, [x])
    t = time.perf_counter()
    out = work(big, n)
    print("running", flush=True)
    jax.block_until_ready(out)
    print("program", time.perf_counter() - t, flush=True)
    sys.stdin.readline()
""")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores: one to keep to, one for the puller")
def test_an_island_kept_to_one_core_serves_a_direct_pull_while_its_device_computes():
    """XLA:CPU sizes its client's thread pool by the cores the process may use when the
    backend starts, and serves a `direct` pull from that pool: kept to one core before
    jax started, an island's pull waited for the whole program it ran after the send."""
    import jax
    from jax.experimental import transfer
    from hetjax.transfer import core
    kept = max(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=str(local.REPO), JAX_PLATFORMS="cpu", HETJAX_CPUS=str(kept),
               XLA_FLAGS=backend.with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), 1))
    port = local.free_ports(1)[0]
    sender = subprocess.Popen([sys.executable, "-c", KEPT_SENDER, str(port), "1.0"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)

    def line() -> str:  # the sender's next line, or an error after 60 s (it is killed below)
        return core.run_async(sender.stdout.readline).result(timeout=60)
    try:
        words = line().split()
        assert words[:2] == ["kept", "True"], words  # every thread of the island, XLA's included
        server = transfer.start_transfer_server(jax.local_devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"])
        connection = server.connect(words[-1])
        sender.stdin.write("go\n")
        sender.stdin.flush()
        assert line().strip() == "running"
        time.sleep(0.05)
        t = time.perf_counter()
        like = jax.ShapeDtypeStruct((64, 128), np.float32, sharding=jax.sharding.SingleDeviceSharding(
            jax.local_devices()[0]))
        pull = core.run_async(lambda: np.asarray(connection.pull(7, [like])[0]))  # in a daemon thread
        got = pull.result(timeout=60)  # a sender gone for good fails the pull once it is killed below
        pulled = time.perf_counter() - t
        program = float(line().split()[-1])
        np.testing.assert_array_equal(got, np.arange(64 * 128, dtype=np.float32).reshape(64, 128))
        assert program > 0.3, f"the program took {program:.3f} s: too short to tell"
        assert pulled < 0.5 * program, f"the pull took {pulled:.3f} s of a {program:.3f} s program"
    finally:
        try:
            sender.stdin.write("done\n")
            sender.stdin.flush()
            sender.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            sender.kill()
            sender.wait()
