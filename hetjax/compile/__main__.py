"""Exports the train and eval steps for other platforms:

    python -m hetjax.compile --config configs/llama8b.py --platforms cuda,rocm --out DIR
        [--devices N] [--config.KEY=VALUE ...]

Lowers on N virtual CPU devices (default: the product of config.mesh) with the
configured mesh and shardings; writes DIR/train_step.jax, DIR/eval_step.jax and
DIR/manifest.json. Load them with hetjax.compile.export.load.
"""

from __future__ import annotations

import sys

from hetjax import cli as cli_lib
from hetjax.compile import backend, cli


def main(argv: list[str]) -> int:
    parser = cli_lib.ArgumentParser(prog="python -m hetjax.compile", description=__doc__.split("\n")[0],
                                    example="python -m hetjax.compile --config tiny --platforms cuda,rocm "
                                            "--devices 8 --out artifacts/tiny")
    parser.add_argument("--platforms", required=True, help="comma-separated: cpu, cuda, rocm")
    parser.add_argument("--out", required=True, help="directory for the artifacts and manifest")
    parser.add_argument("--devices", type=int, help="virtual device count (default: config.mesh)")
    ns, cfg = cli.parse(parser, argv)
    cli_lib.need("flatbuffers", "export", "python -m hetjax.compile (jax.export's serialization)")
    from hetjax.compile import profiles
    platforms = profiles.check_platforms([p.strip() for p in ns.platforms.split(",")], "--platforms")
    cli_lib.output_dir(ns.out, "--out")  # before compiling anything
    backend.virtual_cpu_devices(cli.device_count(cfg, ns.devices))
    from hetjax.compile import export
    from hetjax.mesh import describe, make_mesh
    mesh = make_mesh(cfg.mesh)
    manifest = export.export(cfg, mesh, platforms, ns.out)
    for name, record in manifest["functions"].items():
        print(f"{ns.out}/{record['file']}: {name} of {cfg.name} for {','.join(platforms)} on mesh "
              f"{describe(mesh)}, {len(record['inputs'])} inputs, {len(record['outputs'])} outputs")
    print(f"{ns.out}/manifest.json: jax {manifest['jax_version']}, config hash {manifest['config_hash'][:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
