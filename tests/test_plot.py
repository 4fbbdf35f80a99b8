"""Pictures a user looks at: `python -m hetjax.plot RUN...` (loss, throughput, MFU, and
each island's times) and `repro check`'s loss gaps. Each PNG is read back as an image."""

import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_profiler import shared_cache

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.image  # noqa: E402

from hetjax import plot  # noqa: E402
from hetjax.errors import ConfigError  # noqa: E402
from hetjax.repro import check  # noqa: E402


def image(path: Path) -> np.ndarray:
    """The PNG's pixels; fails unless it is a real picture with something drawn on it."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 300, pixels.shape
    assert pixels[..., :3].std() > 0.05  # not a blank canvas
    return pixels


def test_repro_check_draws_the_loss_gaps_and_plot_draws_both_runs(tmp_path, tmp_path_factory, capsys):
    small = {"eval_every": "0", "tensorboard": "false", "peak_tflops": "1", "data.num_documents": "2000",
             "checkpoint.every": "0", "compile.cache_dir": shared_cache(tmp_path_factory)}
    code, rows = check.check("tiny", "fsdp=1; fsdp=2", tmp_path / "check", small, steps=2)
    out = capsys.readouterr().out
    assert code == 0 and all(r.ok for r in rows), out
    gaps = tmp_path / "check" / "loss_gaps.png"
    assert f"loss gaps: {gaps}" in out
    image(gaps)

    assert plot.main([*(str(r.run_dir) for r in rows), "--out", str(tmp_path / "two.png")]) == 0
    assert str(tmp_path / "two.png") in capsys.readouterr().out
    three_panels = image(tmp_path / "two.png")
    train_rows, _ = plot.read_metrics(rows[0].run_dir)
    assert [row["step"] for row in train_rows] == [0, 1] and "mfu_maxtext" in train_rows[0]

    # An islands run gets a fourth panel: the figure is taller by one panel's height.
    islands_run = islands_metrics(tmp_path / "islands")
    plot.draw([islands_run], tmp_path / "islands.png")
    four_panels = image(tmp_path / "islands.png")
    assert four_panels.shape[0] == pytest.approx(three_panels.shape[0] * 4 / 3, rel=0.02)


def islands_metrics(run_dir: Path) -> Path:
    """metrics.jsonl as an islands job over two processes writes them: the first process's
    in run_dir with its island's series, the other's under run_dir/islands/<island>-<pid>/."""
    (run_dir / "islands" / "rocm-0").mkdir(parents=True)
    main, other = [], []
    for s in range(6):
        common = {"step": s, "loss": 5.5 - 0.1 * s, "tokens": 1000.0, "step_time": 0.1, "tokens_per_sec": 1e4 + s,
                  "mfu": 0.08, "mfu_maxtext": 0.075, "data_wait_time": 0.001}
        main.append({**common, "cuda/step_time": 0.1, "cuda/transfer_time": 0.02})
        # The other process's own view of the step (its clock, its MFU) is not the job's.
        other.append({**common, "tokens_per_sec": 1e3, "step_time": 1.0, "mfu": 0.5,
                      "rocm/step_time": 0.09 + 0.001 * s, "rocm/transfer_time": 0.03})
    main.insert(3, {"step": 2, "eval_loss": 5.4})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in main) + '{"step": 6, "lo')
    (run_dir / "islands" / "rocm-0" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in other))
    return run_dir


def test_an_islands_run_reads_as_one_series_per_island_with_its_evals(tmp_path):
    rows, evals = plot.read_metrics(islands_metrics(tmp_path))
    assert [r["step"] for r in rows] == list(range(6))  # the torn last line is skipped
    assert plot.islands(rows) == ["cuda", "rocm"]
    assert rows[4]["rocm/step_time"] == pytest.approx(0.094) and rows[4]["cuda/transfer_time"] == 0.02
    assert [r["warmup"] for r in rows] == [True] + [False] * 5  # the first row of each file
    # The job's series are the writer's (they were whichever file sorted last).
    assert [r["tokens_per_sec"] for r in rows] == [1e4 + s for s in range(6)]
    assert {r["step_time"] for r in rows} == {0.1} and {r["mfu"] for r in rows} == {0.08}
    assert evals == [{"step": 2, "eval_loss": 5.4}]


def test_a_directory_without_metrics_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}: no metrics.jsonl"):
        plot.read_metrics(tmp_path)


def test_without_matplotlib_plot_names_the_extra(tmp_path):
    from tests.test_commands import run
    islands_metrics(tmp_path)
    r = run("hetjax.plot", str(tmp_path), blocked="matplotlib")
    assert r.returncode == 2 and "pip install 'hetjax[plot]'" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "curves.png").exists()


def test_a_resumed_run_s_throughput_breaks_at_the_resume_instead_of_joining_across_it(tmp_path):
    """The left-out warm-up step of a resume was skipped, and the line joined step 3's
    steady figure to step 5's across it, as if no restart had happened."""
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "tokens_per_sec": 100.0 + s, "mfu": 0.01, "step_time": 0.1,
             **({"run_start": 1.0} if s in (0, 4) else {})} for s in range(7)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    read, _ = plot.read_metrics(tmp_path)
    steps, values = plot.steady(read, "tokens_per_sec")
    assert steps == list(range(7))
    assert [np.isnan(v) for v in values] == [True, False, False, False, True, False, False]
    assert values[3] == 103.0 and values[5] == 105.0
    plot.draw([tmp_path], tmp_path / "resumed.png")
    image(tmp_path / "resumed.png")
