"""Checks every link of an islands job before training, at the job's own addresses.

    python -m hetjax.hetero.linkcheck --config X [--config.KEY=VALUE ...] [--mib 64] [--iters 3]

Start it exactly as hetjax.train (launch.local's `command`, the SLURM script's
HETJAX_MODULE, the JobSet's container args): each process joins its island's
jax.distributed world and opens the same links, with the same backend, secret, hosts and
ports as training (hetero.Links). Every pair of islands then exchanges, both ways at once,
a uint32 array sharded over every device of each island, so the transfer plans shard by
shard between two different meshes as training does, and each side checks every bit it
received. Each process prints one line per link:

    [linkcheck] cuda<->rocm (host): 64 MiB each way in 0.210 s (median of 3) = 0.32 GB/s;
    a small message 1.9 ms; data OK

and exits 0 when every link carried the right data; 1, naming the link, when not.
A peer that never answers is an IslandLost error after link.timeout_s.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from hetjax import cli as cli_lib  # `cli` below is the console entry point
from hetjax import config as config_lib
from hetjax.errors import ConfigError, JobError
from hetjax.hetero import job as hetero_job, runtime
from hetjax.hetero.island import geometry, make_mesh
from hetjax.hetero.links import IslandLost, Links, link_config
from hetjax.mesh import MESH_AXES

SPEC = PartitionSpec(MESH_AXES)  # dim 0 over every device of the island


def pattern(n: int, k: int, sharding) -> jax.Array:
    """Island k's test array: n uint32 words that differ from every other island's."""
    def make():
        i = jnp.arange(n, dtype=jnp.uint32)
        return i * jnp.uint32(2654435761) + jnp.uint32(0x9E3779B9) * jnp.uint32(k + 1)
    return jax.block_until_ready(jax.jit(make, out_shardings=sharding)())


@jax.jit
def _equal(a, b):
    return jnp.all(a == b)


def intact(received: jax.Array, want: jax.Array) -> bool:
    """Whether `received` holds `want` (a pattern), bit for bit."""
    return bool(_equal(received, want))


def exchange(links: Links, j: int, x: jax.Array, what: str) -> tuple[jax.Array, float]:
    """Sends x to island j and receives j's array of the same shape; (theirs, seconds)."""
    theirs = geometry(links.cfg, j).layout(SPEC)  # j sends and receives with this layout
    like = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    t = time.perf_counter()
    sent = links.send(j, x, what, theirs)
    try:
        got = links.wait(links.recv(j, what, like, theirs), j)
    except IslandLost:
        links.raise_failed_sends([(j, sent)])  # e.g. the peer refused our secret
        raise
    links.wait(sent, j, sent=True)  # a failed send is our link to j, and its wait a send's
    jax.block_until_ready(got)
    return got, time.perf_counter() - t


def check_link(links: Links, j: int, mesh, mib: int, iters: int, say) -> bool:
    """Times and checks the link between this island and island j; True when intact."""
    k, cfg = links.k, links.cfg
    step = cfg.hetero.islands[k].devices * cfg.hetero.islands[j].devices  # both meshes split dim 0 evenly
    n = max(step, (mib << 20) // 4 // step * step)
    sharding = NamedSharding(mesh, SPEC)
    big, small, want = pattern(n, k, sharding), pattern(step, k, sharding), pattern(n, j, sharding)
    names = [links.names[min(k, j)], links.names[max(k, j)]]
    seconds, ok = [], True
    for it in range(iters + 1):  # the first round opens connections and compiles: not timed
        theirs, dt = exchange(links, j, big, f"linkcheck/big/{it}")
        ok &= intact(theirs, want)
        seconds.append(dt)
    latency = [exchange(links, j, small, f"linkcheck/small/{it}")[1] for it in range(iters + 1)]
    t = statistics.median(seconds[1:])
    say(f"{names[0]}<->{names[1]} ({link_config(cfg, k, j).backend}): {n * 4 / 2**20:.1f} MiB each way in "
        f"{t:.3f} s (median of {iters}) = {n * 4 / t / 1e9:.2f} GB/s; a small message "
        f"{statistics.median(latency[1:]) * 1e3:.1f} ms; data {'OK' if ok else 'CORRUPTED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    runtime.follow_launcher()  # started by launch.local: end with it
    args = cli_lib.parse_command_line(sys.argv[1:] if argv is None else argv, flags=(), doc=__doc__,
                                      options={"mib": "64", "iters": "3"})
    sizes = {}
    for name, value in args.options.items():
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"--{name}={value!r}: give a whole number of at least 1")
        sizes[name] = int(value)
    cfg = config_lib.load(args.config, args.overrides)
    config_lib.validate(cfg)
    if len(cfg.hetero.islands) < 2 or cfg.hetero.virtual:
        raise ConfigError(f"--config={args.config!r}: the link check needs config.hetero.islands (2 or more) "
                          f"run as processes (config.hetero.virtual=False; launch.local, the SLURM script or "
                          f"the JobSet set it)")
    line, settings = hetero_job.start(cfg)
    names = [i.name for i in cfg.hetero.islands]
    k = names.index(settings.island)

    def say(text):
        print(f"[linkcheck] {text}", flush=True)

    say(line)
    mesh = make_mesh(geometry(cfg, k), jax.devices())
    links = Links(cfg, k, settings, job_id="linkcheck/")
    ok = True
    try:
        # Every pair of islands (training uses them all: neighbours for activations, every
        # pair for gradients and scalars), one pair at a time in one order that every
        # island follows, so no island waits on a peer that is busy with a third one.
        for pair in itertools.combinations(range(len(names)), 2):
            if k in pair:
                ok &= check_link(links, pair[0] + pair[1] - k, mesh, sizes["mib"], sizes["iters"], say)
    except JobError as e:
        say(f"FAILED: {type(e).__name__}: {e}")
        return 1
    finally:
        links.close()
    if not ok:
        say("FAILED: a link delivered data that differs from what was sent (see CORRUPTED above)")
    return 0 if ok else 1


def cli() -> int:
    return cli_lib.run_main(main, (JobError,))


if __name__ == "__main__":
    sys.exit(cli())
