"""Where an island's step time goes (hetjax.hetero.timeline): each part is checked
against waits and programs of known length, and the trace a profiled job writes is
checked against the schedule it ran."""

import json
import threading
import time
from concurrent import futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.hetero import timeline as timeline_lib
from hetjax.transfer import core
from hetjax.launch.local import cpu_shares


def finishing(after_s: float, first_byte_s: float | None) -> core.Handle:
    """A handle whose first byte arrives after first_byte_s and whose result after after_s;
    handle.first_byte is when the first byte came. Tests compare the timeline with the times
    they see, not the nominal ones: a loaded CI machine once woke a 0.05 s sleeper 0.9 s late."""
    handle = core.Handle(futures.Future(), "recv 'x' from source process 0")

    def later():
        start = time.perf_counter()
        if first_byte_s is not None:
            time.sleep(first_byte_s)
            handle.first_byte = time.perf_counter()
            handle.arriving()
        time.sleep(max(0.0, after_s - (time.perf_counter() - start)))
        handle.future.set_result(None)

    threading.Thread(target=later, daemon=True).start()
    return handle


def test_a_wait_counts_as_peer_until_the_first_byte_then_as_bytes():
    tl = timeline_lib.Timeline("a", 0)
    tl.begin(0)
    handle = finishing(0.30, 0.20)
    t = time.perf_counter()
    handle.wait()
    done = time.perf_counter()
    tl.waited(handle, t, sent=False)
    sent = finishing(0.05, None)
    t_sent = time.perf_counter()
    sent.wait()
    sent_done = time.perf_counter()
    tl.waited(sent, t_sent, sent=True)
    parts = tl.end()
    assert parts["wait_peer"] == pytest.approx(handle.first_byte - t, abs=0.02)  # about 0.20
    assert parts["wait_bytes"] == pytest.approx(done - handle.first_byte, abs=0.02)  # about 0.10
    assert parts["wait_sends"] == pytest.approx(sent_done - t_sent, abs=0.02)  # about 0.05
    assert parts["wait_peer"] > 0.15 and parts["wait_bytes"] > 0.05
    # The parts of the step add up to the step.
    assert sum(parts[p] for p in timeline_lib.PARTS) == pytest.approx(parts["step"], rel=0.02, abs=1e-3)


def test_a_wait_whose_first_byte_is_unseen_is_all_peer():
    tl = timeline_lib.Timeline("a", 0)
    tl.begin(0)
    handle = finishing(0.10, None)  # the direct backend does not see its first byte
    t = time.perf_counter()
    handle.wait()
    done = time.perf_counter()
    tl.waited(handle, t, sent=False)
    parts = tl.end()
    assert parts["wait_peer"] == pytest.approx(done - t, abs=0.02) and parts["wait_bytes"] == 0


def test_own_programs_count_as_compute_not_as_a_wait():
    x = jnp.ones((1024, 1024))
    f = jax.jit(lambda x: [x := jnp.tanh(x @ x) for _ in range(8)][-1]).lower(x).compile()
    jax.block_until_ready(f(x))
    alone = []  # the program's own time, measured by blocking on it (the least of three: CI's load)
    for _ in range(3):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        alone.append(time.perf_counter() - t)
    tl = timeline_lib.Timeline("a", 0)
    call = tl.program("f", f)
    counted = []
    for step in range(3):
        tl.begin(step)
        call(x)
        tl.settle()  # what Links.wait does before waiting on a peer
        parts = tl.end()
        assert parts["wait_peer"] == parts["wait_bytes"] == 0
        counted.append(parts["dispatch"] + parts["compute"])
    assert max(counted) >= 0.7 * min(alone), (counted, alone)


def test_a_window_records_only_its_steps_and_writes_a_trace(tmp_path):
    tl = timeline_lib.Timeline("cuda", 0, window=(1, 2))
    f = tl.program("f", jax.jit(lambda x: x + 1))
    for step in range(3):
        tl.begin(step)
        f(jnp.zeros(3), label=f"F{step}")
        tl.settle()
        tl.end()
    path = tl.write(tmp_path)
    events = json.loads(path.read_text())["traceEvents"]
    steps = [e["name"] for e in events if e.get("cat") == "step"]
    assert steps == ["step 1"]
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert "F1" in names and "F0" not in names and "F2" not in names


def test_the_window_s_programs_are_named_in_the_jax_profiler_trace_too(tmp_path):
    """The README promises an islands run's jax.profiler trace the timeline's names as
    annotations; Timeline.program added none."""
    import gzip
    tl = timeline_lib.Timeline("cuda", 0, window=(1, 2))
    f = tl.program("f", jax.jit(lambda x: x + 1))
    f(jnp.zeros(3))  # compiled before the trace
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    try:
        for step in range(3):
            tl.begin(step)
            f(jnp.zeros(3), label=f"F{step}")
            tl.settle()
            tl.end()
    finally:
        jax.profiler.stop_trace()
    perfetto, = tmp_path.rglob("perfetto_trace.json.gz")
    names = {e.get("name") for e in json.loads(gzip.decompress(perfetto.read_bytes()))["traceEvents"]}
    assert "F1" in names and not {"F0", "F2"} & names  # only the window's steps are annotated


def _island_trace(run_dir, island, rank=0, window=(0, 1)):
    tl = timeline_lib.Timeline(island, 0 if island == "cuda" else 1, rank=rank, window=window)
    f = tl.program("f", jax.jit(lambda x: x + 1))
    tl.begin(window[0])
    f(jnp.zeros(3), label="F0")
    tl.settle()
    tl.end()
    return tl.write(run_dir)


def test_merge_leaves_out_an_earlier_job_s_traces_and_names_a_cut_file(tmp_path, capsys):
    """trace/ kept an earlier job's files (another rank, an hour ago; one written before
    files carried their span) and merge mixed them in; a file cut short by a kill was a
    bare JSONDecodeError."""
    stale = [_island_trace(tmp_path, "cuda", rank=1), _island_trace(tmp_path, "rocm", rank=1)]
    for i, path in enumerate(stale):
        trace = json.loads(path.read_text())
        for e in trace["traceEvents"]:
            if "ts" in e:
                e["ts"] -= 3600e6
        if i == 0 and "otherData" in trace:
            trace["otherData"]["span_us"] = [t - 3600e6 for t in trace["otherData"]["span_us"]]
        else:
            trace.pop("otherData", None)  # as the code before wrote them
        path.write_text(json.dumps(trace))
    current = [_island_trace(tmp_path, "cuda"), _island_trace(tmp_path, "rocm")]
    assert timeline_lib.main([str(tmp_path), "--png", str(tmp_path / "t.png")]) == 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {"island cuda (rank 0)", "island rocm (rank 0)"}, names
    out = capsys.readouterr().out
    assert all(f"{p}: left out, an earlier job's trace" in out for p in stale), out

    # A kill mid-write leaves the previous file whole: the write goes to a temporary name.
    real = type(current[1]).write_text

    def killed(self, text, *a, **k):
        real(self, text[: len(text) // 2])
        raise KeyboardInterrupt
    with pytest.MonkeyPatch.context() as m:
        m.setattr(type(current[1]), "write_text", killed)
        with pytest.raises(KeyboardInterrupt):
            _island_trace(tmp_path, "rocm")
    assert timeline_lib.main([str(tmp_path), "--png", str(tmp_path / "t.png")]) == 0
    # A file cut short anyway (copied, or by an older hetjax) is named, not a traceback.
    current[1].write_text(current[1].read_text()[:50])
    assert timeline_lib.main([str(tmp_path), "--png", str(tmp_path / "t.png")]) == 1
    err = capsys.readouterr().err
    assert f"error: {current[1]}: not a readable island trace" in err and "delete it" in err, err


def test_the_ranks_of_one_island_merge_onto_their_own_tracks(tmp_path):
    for rank in (0, 1):
        tl = timeline_lib.Timeline("cuda", 0, rank=rank, window=(0, 1))
        f = tl.program("f", jax.jit(lambda x: x + 1))
        tl.begin(0)
        f(jnp.zeros(3), label="F0")
        tl.message("send x", finishing(0.01, None))
        tl.settle()
        time.sleep(0.05)
        tl.end()
        tl.write(tmp_path)
    _, events = timeline_lib.merge(tmp_path)
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(names.values()) == ["island cuda (rank 0)", "island cuda (rank 1)"]
    spans = [e for e in events if e.get("ph") == "X" and e["name"] == "F0"]
    assert len({e["pid"] for e in spans}) == 2  # one per rank, not one track drawn twice
    ids = [(e["cat"], e["id"]) for e in events if e.get("ph") == "b"]
    assert len(ids) == len(set(ids)) == 2  # async message ids are unique across the ranks


def test_the_cores_are_shared_out_disjointly_in_proportion():
    assert cpu_shares([2, 2], [0, 1]) == [(0,), (1,)]
    assert cpu_shares([1, 3], [0, 1, 2, 3]) == [(0,), (1, 2, 3)]
    assert cpu_shares([2, 2, 2], [0, 1]) is None  # fewer cores than processes: no pinning
    rng = np.random.default_rng(0)
    for _ in range(50):
        devices = list(rng.integers(1, 5, size=rng.integers(1, 5)))
        cores = sorted(rng.choice(64, size=rng.integers(len(devices), 17), replace=False).tolist())
        shares = cpu_shares(devices, cores)
        flat = [c for s in shares for c in s]
        assert sorted(flat) == cores and all(shares)  # every core once, every process some


def test_a_one_mesh_job_writes_a_jax_profiler_trace_of_its_window(tmp_path):
    from hetjax import train
    code = train.main(["--config", "configs/tiny.py", f"--config.run_dir={tmp_path}", "--config.steps=4",
                       "--config.eval_every=0", "--config.tensorboard=False", "--config.profile_steps=1:3",
                       "--config.checkpoint.every=0"])
    assert code == 0
    assert list((tmp_path / "profile").rglob("*.xplane.pb"))


def test_a_profile_window_before_the_first_step_is_refused_naming_both_fields():
    """steps=5, data.start_step=3, profile_steps=0:2 used to trace nothing in silence."""
    from hetjax.config import ConfigError, Config, DataConfig, validate
    with pytest.raises(ConfigError, match=r"config\.profile_steps='0:2': its last step 1 is before "
                                          r"config\.data\.start_step=3.*pick B > 3"):
        validate(Config(steps=5, data=DataConfig(start_step=3), profile_steps="0:2"))
    validate(Config(steps=5, data=DataConfig(start_step=3), profile_steps="0:4"))  # step 3 is traced


@pytest.mark.parametrize("text", ["3", "5:5", "a:b", "-1:2", "4:2"])
def test_a_bad_profile_window_is_refused_naming_the_field(text):
    from hetjax.config import ConfigError, Config, validate
    with pytest.raises(ConfigError, match=r"config\.profile_steps=.*A:B"):
        validate(Config(profile_steps=text))


def test_every_logged_step_of_a_run_that_evals_has_a_real_step_time(tmp_path):
    # The step clock waits on each step's results: no step before an eval, at the start or
    # at the end is a few microseconds of dispatch (which read as an MFU above 1).
    from hetjax import train
    code = train.main(["--config", "configs/tiny.py", f"--config.run_dir={tmp_path}", "--config.steps=12",
                       "--config.eval_every=4", "--config.tensorboard=False", "--config.checkpoint.every=0"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows if "step_time" in r]
    assert len(times) == 12
    typical = float(np.median(times))
    assert min(times) > 0.3 * typical, times
    assert max(r["mfu"] for r in rows if "mfu" in r) < 1


def test_the_receive_pool_never_hands_out_memory_still_in_use():
    from hetjax.transfer.buffers import BufferPool
    pool = BufferPool()
    a = pool.take((64, 64), np.float32)
    view = a[3:5]  # any view keeps the memory in use
    del a
    b = pool.take((64, 64), np.float32)
    assert not np.shares_memory(b, view)
    adopted = jax.device_put(b, jax.devices()[0])  # jax on CPU adopts it without a copy
    del b, view  # the first buffer is free again; the second is the jax array's
    c = pool.take((64, 64), np.float32)
    assert not np.shares_memory(c, np.asarray(adopted))
    del c, adopted
    import gc
    gc.collect()
    d = pool.take((64, 64), np.float32)
    assert sum(len(v) for v in pool._held.values()) == 2  # c and d reused free ones: no third buffer
    del d
