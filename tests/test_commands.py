"""Every command a user can run answers --help with an example, and one whose optional
dependency is missing says in one line which extra installs it (its import blocked)."""

import os
import subprocess
import sys
from pathlib import Path

from tests.helps import help_texts

ROOT = Path(__file__).resolve().parent.parent

COMMANDS = ["hetjax.train", "hetjax.data.prepare", "launch.local", "hetjax.compile", "hetjax.plan",
            "hetjax.pipeline", "hetjax.repro", "hetjax.convert", "hetjax.transfer.probe",
            "hetjax.hetero.linkcheck", "hetjax.hetero.timeline", "hetjax.hetero.checkpoints", "hetjax.plot",
            "bench.step_overhead", "bench.checkpoint_cost", "bench.data_throughput", "bench.gpu_step",
            "bench.hetero_vs_homogeneous", "bench.multiprocess_overhead", "bench.pipeline_bubble",
            "bench.prepare_throughput", "bench.transfer_bandwidth", "bench.collective_latency"]

# Runs a module as `python -m` would, with some imports made to fail as if not installed.
BLOCKED = """
import runpy, sys
blocked, module, *args = sys.argv[1:]
for name in blocked.split(","):
    sys.modules[name] = None  # `import name` now raises ImportError
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def run(module, *args, blocked="", timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", BLOCKED, blocked, module, *args], capture_output=True,
                          text=True, cwd=ROOT, env=env, timeout=timeout)


def test_every_command_answers_help_with_an_example():
    for module, (code, out) in help_texts(COMMANDS).items():
        assert code == 0, (module, out[-2000:])
        # an example: the command with an argument, on a line other than argparse's usage
        examples = [line for line in out.splitlines() if f"python -m {module} -" in line
                    or f"python -m {module} " in line and not line.startswith("usage:")]
        assert examples, (module, out)


def test_options_take_dashes_or_underscores(tmp_path):
    from hetjax import cli
    p = cli.ArgumentParser(prog="x", example="x --max_shard_gb 5")
    p.add_argument("--max_shard_gb", type=float)
    p.add_argument("--norm-rtol", type=float)
    assert vars(p.parse_args(["--max-shard-gb", "2", "--norm_rtol=0.5"])) == {"max_shard_gb": 2.0,
                                                                             "norm_rtol": 0.5}
    assert "example:\n  x --max_shard_gb 5" in p.format_help()
    # the hand-parsed commands too: prepare's --docs_per_shard spelled with dashes reaches its check
    r = run("hetjax.data.prepare", "--input", "a", "--output", "b", "--docs-per-shard", "0")
    assert r.returncode == 2 and "--docs_per_shard='0': give an integer >= 1" in r.stderr, r.stderr


def _one_line(r, extra):
    lines = [line for line in r.stderr.splitlines() if f"pip install 'hetjax[{extra}]'" in line]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_export_without_flatbuffers_names_its_extra(tmp_path):
    r = run("hetjax.compile", "--config", "tiny", "--platforms", "cpu", "--devices", "1", "--out",
            str(tmp_path / "art"), blocked="flatbuffers")
    assert r.returncode == 2
    _one_line(r, "export")
    assert not (tmp_path / "art").exists()  # refused before lowering anything


def test_pictures_without_matplotlib_name_their_extra(tmp_path):
    r = run("hetjax.pipeline", "--stages", "2", "--microbatches", "2", "--png", str(tmp_path / "t.png"),
            blocked="matplotlib")
    assert r.returncode == 2 and not (tmp_path / "t.png").exists()
    _one_line(r, "plot")
    r = run("hetjax.plan", "--config", "tiny", "--devices", "2", "--mesh", "fsdp=2;data=2",
            "--out", str(tmp_path / "plan"), blocked="matplotlib")
    assert r.returncode == 2 and not (tmp_path / "plan").exists()  # before compiling anything
    _one_line(r, "plot")


def test_compare_without_matplotlib_keeps_its_verdict_and_exit_code(tmp_path):
    # a run compared with its copy: bit-identical, exit 0, and no picture
    import shutil
    from hetjax import train
    assert train.main(["--config", "tiny", f"--config.run_dir={tmp_path / 'a'}", "--config.steps=2",
                       "--config.eval_every=0", "--config.tensorboard=False", "--config.checkpoint.every=0",
                       "--config.model.num_layers=1", "--config.fingerprint_every=1"]) == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    r = run("hetjax.repro", "compare", str(tmp_path / "a"), str(tmp_path / "b"), blocked="matplotlib")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "identical" in r.stdout.lower(), r.stdout
    _one_line(r, "plot")
    assert not (tmp_path / "b" / "compare.png").exists()


def test_a_bad_number_is_one_error_line_and_exit_2_before_any_work():
    """No traceback: the flag, its value and what it must be (a negative tolerance would
    fail every comparison; the probe's counts are checked before any process starts)."""
    cases = {("hetjax.transfer.probe", "--streams", "0"): "error: --streams=0: must be at least 1",
             ("hetjax.repro", "compare", "a", "b", "--rtol", "-1"): "error: --rtol=-1.0: a tolerance",
             ("hetjax.repro", "check", "--config", "tiny", "--fingerprint-every", "0"):
                 "error: --fingerprint-every=0: must be at least 1"}
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    procs = {said: subprocess.Popen([sys.executable, "-m", *args], stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    env=env) for args, said in cases.items()}
    for said, p in procs.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 2 and err.startswith(said) and "Traceback" not in err, (p.args, err)
