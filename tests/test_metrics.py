"""The console output of a run: in a terminal the progress bar fits 80 columns with the
loss first, and every log_every-th step's full line stays above it, in the scrollback."""

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

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
