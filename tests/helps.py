"""Commands' --help texts, all from one child process.

Each command is run as `python -m` runs it (runpy, as __main__), but in one interpreter
that imports jax and its kin once: a process per command paid about 1.5 CPU-s of imports
each, 60 CPU-s of the suite for the two tests that read every command's help.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_RUN_ALL = """
import contextlib, io, json, runpy, sys, traceback
out = {}
for module in sys.argv[1:]:
    text, code = io.StringIO(), 0
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:
        text.write(traceback.format_exc())
        code = 1
    out[module] = [code, text.getvalue()]
json.dump(out, sys.__stdout__)
"""


def help_texts(modules) -> dict[str, tuple[int, str]]:
    """{module: (exit status, stdout and stderr)} of `python -m module --help`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _RUN_ALL, *modules], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return {m: (code, text) for m, (code, text) in json.loads(r.stdout).items()}
