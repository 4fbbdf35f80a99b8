"""argv -> what a command runs: `--config FILE`, `--config.a.b=v` overrides, the command's
own flags and options, `--help`, and the exit status of a failure.

Every command (hetjax.train, hetjax.data.prepare, launch.local, ...) parses its argv here
and wraps its main in `run_main`, so all of them read and fail the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import sys

from hetjax.errors import ConfigError, HetjaxError, MissingExtra


@dataclasses.dataclass
class CommandLine:
    """A parsed command line: the config file, its overrides, flags and options."""

    config: str
    overrides: dict[str, str]
    compile_only: bool = False
    options: dict = dataclasses.field(default_factory=dict)  # the command's own --name=value


def run_main(main, errors: tuple = ()) -> int:
    """A command's exit status: main()'s, or 2 after `error: ...` for a ConfigError (the
    user's input), or 1 after it for one of `errors` or any other HetjaxError (the run failed)."""
    try:
        return main()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (HetjaxError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _known(flags, options: dict) -> list[str]:
    return (["--config", "--config.KEY=VALUE"] + [f"--{f}" for f in flags]
            + [f"--{o}=VALUE" for o in options])


def _help(doc: str | None, flags, options: dict) -> str:
    lines = [doc.strip(), ""] if doc else []
    lines += ["arguments:",
              "  --config FILE          the experiment: configs/NAME.py, NAME.py or NAME (its get_config())",
              "  --config.KEY=VALUE     override one field, e.g. --config.steps=10 --config.model.num_layers=4"]
    lines += [f"  --{f}" for f in flags]
    lines += [f"  --{o}=VALUE" + (f"  (default: {v})" if v not in (None, "") else "")
              for o, v in options.items()]
    lines += ["  -h, --help             print this and exit"]
    return "\n".join(lines)


def parse_command_line(argv: list[str], flags: tuple[str, ...] = ("compile_only",),
                       options: dict | None = None, doc: str | None = None) -> CommandLine:
    """Parses `--config X`, `--config.a.b=v` (or `--config.a.b v`), boolean flags, and the
    command's own options `--name=v` (or `--name v`), whose defaults `options` gives.
    `--help` (or `-h`) prints `doc` (the command's docstring) and the arguments, and exits 0."""
    name, overrides, seen = None, {}, set()
    values = dict(options or {})
    if "--help" in argv or "-h" in argv:
        print(_help(doc, flags, values))
        raise SystemExit(0)
    args = list(argv)
    while args:
        arg = args.pop(0)
        key, eq, value = arg.partition("=")
        if key == "--config":
            if name is not None:  # the second would replace the first without a word
                raise ConfigError(f"--config given twice ({name!r}, then {value if eq else args[0] if args else ''!r}); "
                                  f"give one config file and change it with --config.KEY=VALUE")
            name = value if eq else (args.pop(0) if args else None)
        elif key.startswith("--config."):
            overrides[key.removeprefix("--config.")] = value if eq else _next_value(arg, args)
        elif key.startswith("--") and key.removeprefix("--").replace("-", "_") in values:
            values[key.removeprefix("--").replace("-", "_")] = value if eq else _next_value(arg, args)
        elif key.removeprefix("--").replace("-", "_") in flags and not eq:
            seen.add(key.removeprefix("--").replace("-", "_"))
        else:
            known = _known(flags, values) + ["--help"]
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]}?" if close else f"known: {', '.join(known)}"
            raise ConfigError(f"unknown argument {arg!r}; {hint}")
    if not name:
        raise ConfigError("--config is required, e.g. --config configs/tiny.py")
    return CommandLine(name, overrides, options=values, **{f: f in seen for f in flags})


def _next_value(arg: str, args: list[str]) -> str:
    """The value of `--name VALUE`: the next argument, unless there is none or it is the
    next option (taken as the value, that option would be lost without a word)."""
    if not args or args[0].startswith("--"):
        raise ConfigError(f"{arg}: give a value, e.g. {arg}=VALUE" + (f" (the next argument, {args[0]}, is an "
                                                                      f"option)" if args else ""))
    return args.pop(0)


def need(module: str, extra: str, what: str):
    """`module` imported, or a MissingExtra saying which extra of hetjax installs it (for `what`)."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{what} needs {module.split('.')[0]}, which is not installed: "
                           f"pip install 'hetjax[{extra}]'") from None


def output_dir(path: str, flag: str):
    """`path` as a directory, made now, before a command's long work: a ConfigError naming
    `flag` if it is a file or cannot be made."""
    from pathlib import Path
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{flag}={path}: is a file; give a directory (it is made if missing)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag}={path}: cannot make this directory ({e.strerror}); give another") from None
    return out


def alias(option: str, known) -> str:
    """`--a-b` for `--a_b` (or back) when only the other spelling is a known option."""
    key, eq, value = option.partition("=")
    if not key.startswith("--") or key in known or key.startswith("--config."):
        return option
    for other in ("--" + key[2:].replace("-", "_"), "--" + key[2:].replace("_", "-")):
        if other in known:
            return other + eq + value
    return option


class ArgumentParser(argparse.ArgumentParser):
    """argparse with hetjax's conventions: `example` closes --help, and an option is
    accepted with dashes or underscores (`--max_shard_gb` or `--max-shard-gb`)."""

    def __init__(self, *args, example: str | None = None, **kwargs):
        if example:
            kwargs["epilog"] = "example:\n  " + example.strip().replace("\n", "\n  ")
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        known = self._option_string_actions
        return super().parse_known_args([alias(a, known) for a in args], namespace)
