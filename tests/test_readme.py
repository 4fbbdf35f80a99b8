"""The README's two commands stay true, and CI runs the README's test command."""

import re
from pathlib import Path

from tests.helps import help_texts

ROOT = Path(__file__).resolve().parent.parent


def _commands():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [line for b in blocks[:2] for line in b.splitlines() if line and not line.startswith("#")]


def test_ci_runs_the_readme_test_command():
    train_cmd, test_cmd = _commands()
    assert "hetjax.train --config configs/tiny_hetero.py" in train_cmd and "pip install" in train_cmd
    assert "pytest" in test_cmd and '".[test]"' in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()


def readme_commands():
    """Every `python -m hetjax|launch|bench...` line of the README's bash blocks: (module, args)."""
    import shlex
    out = []
    for block in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            m = re.search(r"python -m ((?:hetjax|launch|bench)\S*)(.*)", line.split(" #")[0])
            if m:
                out.append((m.group(1), [a.strip("[]") for a in shlex.split(m.group(2))]))
    return out


def test_every_readme_command_names_a_module_options_and_config_keys_that_exist():
    # A doc check: each command's module runs, each --option it shows is in the module's
    # --help, and its --config with its --config.KEY=VALUE overrides loads (unknown keys fail).
    import importlib.util
    from hetjax import config as config_lib
    commands = readme_commands()
    assert len(commands) > 20, commands
    modules = sorted({m for m, _ in commands})
    for m in modules:
        assert importlib.util.find_spec(m) is not None, m
    helps = {m: out.replace("-", "_") for m, (_, out) in help_texts(modules).items()}
    for module, args in commands:
        options = [a.split("=")[0] for a in args if a.startswith("--") and not a.startswith("--config.")]
        for option in options:
            assert option.replace("-", "_") in helps[module], (module, option, helps[module])
        if "--config" in args:
            name = args[args.index("--config") + 1]
            if name in ("X", "CONFIG") or "X.py" in name:
                continue  # a placeholder
            overrides = dict(a.removeprefix("--config.").split("=", 1) for a in args if a.startswith("--config."))
            config_lib.load(name, overrides)


def test_the_readme_repro_check_layouts_fit_their_config():
    # `repro check`'s layouts each split the model over 8 devices (program.build: abstract,
    # nothing allocated); tiny's 2 kv heads do not split over tensor=4.
    from hetjax import config as config_lib
    from hetjax import program
    from hetjax.mesh import make_mesh
    from hetjax.repro import check
    checks = [args for module, args in readme_commands() if module == "hetjax.repro" and args[0] == "check"]
    assert checks
    for args in checks:
        name, layouts = args[args.index("--config") + 1], args[args.index("--layouts") + 1]
        overrides = dict(a.removeprefix("--config.").split("=", 1) for a in args if a.startswith("--config."))
        cfg = config_lib.load(name, overrides)
        for item, sizes in check.parse(layouts):
            if "islands" in sizes:
                continue  # islands choose their own meshes (tests/test_repro.py runs one)
            lay = check.layout(item, sizes, cfg, 8, name)
            laid = config_lib.load(name, {**overrides, **lay.overrides})
            config_lib.validate(laid)
            program.build(laid, make_mesh(laid.mesh))


def test_the_readme_points_only_at_files_in_the_repository():
    text = (ROOT / "README.md").read_text()
    assert "../" not in text  # a clone has nothing beside the repository
    named = set(re.findall(r"`((?:docs|hetjax|bench|launch|configs|models|tests)/[\w./-]+\.(?:md|py|sh|yaml|sbatch))`",
                           text))
    assert "docs/DESIGN.md" in named
    assert [p for p in sorted(named) if not (ROOT / p).exists()] == []
