"""The console output of a run: in a terminal the progress bar fits 80 columns with the
loss first, and every log_every-th step's full line stays above it, in the scrollback."""

import fcntl
import importlib.util
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STEPS = """
import sys, pathlib
from hetjax.metrics import Writer
w = Writer(pathlib.Path(sys.argv[1]), 30, tensorboard=False)
for s in range(30):
    w.write(s, {"grad_norm": 1.2345, "learning_rate": 3e-4, "tokens": 4096, "step_time": 0.0123,
                "tokens_per_sec": 333000.0, "mfu": 0.01234, "loss": 5.0 - s / 10, "above_floor": 1.0},
            echo=s % 10 == 0 or s == 29)
    if s == 19:
        w.write(s, {"eval_loss": 2.5}, echo=True)
w.close()
"""


def in_a_terminal(code: str, *args, columns: int = 80) -> str:
    """What `python -c code` shows in a terminal `columns` wide (escape sequences removed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    p = subprocess.Popen([sys.executable, "-c", code, *args], stdin=slave, stdout=slave, stderr=slave,
                         cwd=ROOT, env=env)
    os.close(slave)
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert p.wait(timeout=120) == 0, out.decode(errors="replace")
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode())


def test_the_bar_shows_the_loss_first_in_80_columns_and_log_lines_stay_above_it(tmp_path):
    text = in_a_terminal(STEPS, str(tmp_path))
    lines = [seg for seg in re.split(r"[\r\n]+", text) if seg.strip()]
    bars = [line for line in lines if "step/s" in line or "s/step" in line]
    assert bars and all(len(line) <= 80 for line in bars), max(bars, key=len)
    postfixed = [line for line in bars if "=" in line]  # the bar drawn before any step has none
    assert postfixed and all(re.search(r"\| \d+/30 \[.*, (loss|eval_loss)=", line) for line in postfixed), bars
    # every logged step's full line, each on its own line (\r-overwritten bars aside)
    logged = [line for line in text.replace("\r", "\n").splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in logged] == ["step 0", "step 10", "step 19", "step 20", "step 29"]
    assert logged[0].startswith("step 0: loss=5 grad_norm=1.234") and "eval_loss=2.5" in logged[2]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 31


# -- FLOP counts, data wait and device memory (metrics.jsonl) ------------------------------


def test_maxtext_flops_of_tiny_match_a_count_by_hand():
    from hetjax import metrics
    from hetjax.config import load
    cfg = load("tiny")  # vocab 256, 2 layers, embed 64, mlp 192, 4 heads, 2 kv heads of 16, seq 64
    q = o = 64 * 4 * 16
    k = v = 64 * 2 * 16
    mlp = 3 * 64 * 192  # gate, up, down
    head = 64 * 256  # the output projection; the input embedding is a lookup
    weights = 2 * (q + k + v + o + mlp) + head
    # Attention per layer and sequence: QKᵀ and AV, S·S·H·d multiply-adds each (4·S²·H·d FLOPs),
    # x3 for forward and backward, half of it under the causal mask; per token over 2 layers.
    causal = 2 * (4 * 64 * 64 * 4 * 16) * 3 / 2 / 64
    assert metrics.maxtext_flops_per_token(cfg) == 6 * weights + causal == 737_280
    # Today's figure (PaLM): 6 × (every parameter but the lookup, norms included) + full attention.
    params = weights + 2 * 2 * 64 + 64  # two norms per layer and the final one
    assert metrics.model_flops_per_token(cfg, params + 256 * 64) == 6 * params + 2 * causal


@pytest.mark.parametrize("change", [{}, {"tie_embeddings": True}, {"qkv_bias": True, "num_kv_heads": 1},
                                    {"num_heads": 8, "num_kv_heads": 8, "head_dim": 8, "num_layers": 3}])
def test_maxtext_weight_flops_are_six_per_weight_of_every_matmul_of_the_model(change):
    # Independent of the formula: the model's own matrices (the stacked layers' weights but
    # their norms' scales and q/k/v biases, the output head, the embedding when it is the head).
    import dataclasses
    import math
    from flax import nnx
    from hetjax import metrics, state as state_lib
    from hetjax.config import load
    cfg = load("tiny")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **change))
    model = nnx.eval_shape(lambda: state_lib.make_model(cfg.model, cfg.seed))
    shapes = {path: v.get_value().shape for path, v in nnx.to_flat_state(nnx.state(model))}
    matrices = sum(math.prod(s) for p, s in shapes.items()
                   if len(s) >= 3 and "bias" not in p[-1] or p in (("unembed_DV",),) or (p == ("embed_VD",) and cfg.model.tie_embeddings))
    m = cfg.model
    causal = 6 * m.num_layers * m.num_heads * m.head_dim * cfg.seq_len
    assert metrics.maxtext_flops_per_token(cfg) == 6 * matrices + causal


def test_peak_device_memory_is_the_largest_device_peak_or_absent_where_not_reported():
    import jax
    from hetjax import metrics

    class Device:  # what jax.Device.memory_stats() returns on a GPU
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats
    assert metrics.peak_memory_gib([Device({"peak_bytes_in_use": 2**30}), Device({"peak_bytes_in_use": 3 << 29})]) == 1.5
    assert metrics.peak_memory_gib([Device(None)]) is None
    assert jax.devices()[0].memory_stats() is None  # CPU reports none: metrics.jsonl has no peak_memory_gib


def test_a_run_logs_its_data_wait_both_mfus_and_no_memory_peak_on_cpu(tmp_path_factory):
    import json
    from hetjax import metrics
    from hetjax.config import load
    from tests.test_profiler import slow_traced_run  # one run, read by both tests
    run_dir = slow_traced_run(tmp_path_factory)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = load("tiny")
    ratio = metrics.maxtext_flops_per_token(cfg) / metrics.model_flops_per_token(cfg, 131_392)
    assert len(rows) == 5
    for row in rows:
        # Every batch took 0.1 s; while the device still runs the step before, the wait hides behind it.
        assert 0.1 <= row["data_wait_time"] < 0.1 + row["step_time"] + 1.0, row
        assert row["mfu_maxtext"] == pytest.approx(row["mfu"] * ratio, rel=1e-12)
        assert "peak_memory_gib" not in row


def _tb_events(path):
    """Every Event of a TensorBoard file (TFRecords: length, its crc, data, its crc)."""
    import struct
    from tensorboardX.proto import event_pb2
    data, pos, out = path.read_bytes(), 0, []
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[pos + 12:pos + 12 + length])
        out.append(event)
        pos += 12 + length + 4
    return out


def test_every_scalar_of_a_step_reaches_tensorboard_in_one_event(tmp_path):
    """A step's scalars go as one event (an event per scalar cost 2.3 ms a step on the
    loop's thread); each series still reads back value for value, names cleaned as
    tensorboardX's own add_scalar cleans them."""
    from tensorboardX.summary import scalar
    from hetjax.metrics import Writer
    written = {s: {"loss": 4.0 - s, "cuda/step_time": 0.05 + s, "grad norm": 2.0 * s} for s in range(3)}
    writer = Writer(tmp_path, 3, tensorboard=True)
    for s, scalars in written.items():
        writer.write(s, scalars)
    writer.close()
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    steps = [e for e in _tb_events(events) if e.HasField("summary")]
    assert [e.step for e in steps] == [0, 1, 2]
    for e in steps:
        want = {scalar(k, v).value[0].tag: pytest.approx(v) for k, v in written[e.step].items()}
        assert {v.tag: v.simple_value for v in e.summary.value} == want
    assert "grad_norm" in {v.tag for v in steps[0].summary.value}  # the space cleaned


@pytest.mark.parametrize("start", [4, 0])
def test_a_resumed_run_tells_tensorboard_to_drop_the_steps_it_runs_again(tmp_path, start):
    """metrics.jsonl is truncated at the resume step; TensorBoard showed steps run twice.
    A run started again from step 0 (it stopped before its first checkpoint) too."""
    from hetjax.metrics import Writer
    first = Writer(tmp_path, 6, tensorboard=True)
    for s in range(6):
        first.write(s, {"loss": float(s)})
    first.close()
    time.sleep(1.1)  # event files are named by the second they start
    again = Writer(tmp_path, 6, tensorboard=True, start_step=start)
    for s in range(start, 6):
        again.write(s, {"loss": 10.0 + s})
    again.close()
    files = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 2
    starts = [(e.step, e.session_log.status) for e in _tb_events(files[1]) if e.HasField("session_log")]
    assert starts == [(start, 1)]  # SessionLog.START there: readers drop the first file's later events


def test_a_step_whose_loss_or_gradient_norm_is_not_finite_stops_the_run_naming_the_steps():
    from hetjax.errors import TrainingDiverged
    from hetjax.metrics import check_finite
    check_finite({"loss": 2.0, "grad_norm": 3.0}, 7, 6)
    with pytest.raises(TrainingDiverged, match=r"the loss is nan at step 7; the last finite loss was at step 4, "
                                              r"so training diverged in steps 5..7"):
        check_finite({"loss": float("nan"), "grad_norm": float("nan")}, 7, 4)
    # A finite loss with a gradient norm that is not: the update makes the next state inf or
    # NaN, which the save after this step would have kept.
    with pytest.raises(TrainingDiverged, match=r"the gradient norm \(so the parameters after it are not\) is inf "
                                              r"at step 7; .* steps 7..7"):
        check_finite({"loss": 2.0, "grad_norm": float("inf")}, 7, 6)


def test_tensorboard_scalars_are_written_without_importing_pytorch(tmp_path):
    """tensorboardX imports torch whenever it is installed (4 s per training process);
    the scalars are written without it, and torch stays importable afterwards."""
    if importlib.util.find_spec("torch") is None:  # found, not imported: this worker's writers stay torch-free
        pytest.skip("torch is not installed: nothing to keep out")
    code = """
import sys, pathlib
from hetjax.metrics import Writer
w = Writer(pathlib.Path(sys.argv[1]), 3, tensorboard=True)
for s in range(3):
    w.write(s, {"loss": 4.0 - s})
w.close()
print("torch imported:", "torch" in sys.modules)
import torch
print("torch importable:", torch.__name__)
"""
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu"), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch imported: False" in out.stdout and "torch importable: torch" in out.stdout, out.stdout
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    losses = [(e.step, v.simple_value) for e in _tb_events(events) for v in e.summary.value if v.tag == "loss"]
    assert losses == [(0, 4.0), (1, 3.0), (2, 2.0)]
