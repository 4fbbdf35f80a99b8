"""Plans a sharding before booking a cluster:

    python -m hetjax.plan --config configs/llama8b.py --devices 64 --mesh data=2,fsdp=8,tensor=4
    python -m hetjax.plan --config llama8b --devices 64 --mesh "fsdp=64;data=2,fsdp=32;fsdp=16,tensor=4"

Compiles the train step on --devices virtual CPU devices with abstract inputs for
each mesh, prints a table of per-device memory, FLOPs, collective traffic and an
estimated step time and MFU per accelerator, and writes OUT/plan.json (and, for a
sweep, OUT/plan.png). Allocates no parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hetjax import cli as cli_lib
from hetjax.compile import backend, cli, hardware


def main(argv: list[str]) -> int:
    parser = cli_lib.ArgumentParser(prog="python -m hetjax.plan", description=__doc__.split("\n")[0],
                                    example='python -m hetjax.plan --config tiny --devices 8 --mesh "fsdp=8;data=2,fsdp=4"')
    parser.add_argument("--devices", type=int, help="device count (default: the --mesh sizes' product, "
                                                    "else config.mesh's)")
    parser.add_argument("--mesh", action="append", default=[],
                        help="AXIS=SIZE,... (repeat, or separate meshes by ';'); default config.mesh")
    parser.add_argument("--hardware", default=",".join(hardware.DEFAULT_HARDWARE), help="comma-separated")
    parser.add_argument("--out", help="directory for plan.json / plan.png (default plans/<config>)")
    ns, cfg = cli.parse(parser, argv)
    from hetjax.compile import plan
    texts = [m for arg in ns.mesh for m in arg.split(";") if m.strip()]
    devices = plan.mesh_devices(texts) if texts and ns.devices is None else cli.device_count(cfg, ns.devices)
    meshes = [plan.parse_mesh(t, devices) for t in texts] or [cfg.mesh]
    if len(meshes) > 1:  # before compiling anything: a sweep ends with its plot
        cli_lib.need("matplotlib", "plot", "python -m hetjax.plan's sweep (plan.png)")
    names = [hardware.get(h.strip()).name for h in ns.hardware.split(",")]
    out = cli_lib.output_dir(ns.out or f"plans/{cfg.name}", "--out")  # before compiling anything
    backend.virtual_cpu_devices(devices)
    import dataclasses
    from hetjax import config as config_lib
    from hetjax.mesh import make_mesh
    # Every mesh passes the trainer's own checks before any compiles: a plan must not
    # recommend what `python -m hetjax.train` then refuses.
    progs = []
    for m in meshes:
        c = dataclasses.replace(cfg, mesh=m)
        config_lib.validate(c)
        progs.append(plan.check_as_the_trainer_does(c, make_mesh(m)))
    reports = []
    for p in progs:
        reports.append(plan.plan(p.cfg, p.mesh, names, p))
        print(f"planned {reports[-1]['config']} on {reports[-1]['mesh']}", file=sys.stderr, flush=True)
    print(plan.table(reports))
    (out / "plan.json").write_text(json.dumps(reports, indent=1) + "\n")
    written = [out / "plan.json"]
    if len(reports) > 1:
        plan.plot(reports, out / "plan.png")
        written.append(out / "plan.png")
    print("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
