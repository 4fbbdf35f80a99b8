"""The README's two commands stay true, and CI runs the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _commands():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line for b in blocks[:2] for line in b.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    train_cmd, test_cmd = _commands()
    assert "hetjax.train --config configs/tiny_hetero.py" in train_cmd and "pip install" in train_cmd
    assert "pytest" in test_cmd and '".[test]"' in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()
