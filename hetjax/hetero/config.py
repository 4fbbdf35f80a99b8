"""config.hetero: the islands of a job, how the model or batch is placed on them, the links."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from hetjax.checkpoint_config import CORRUPT_DIR
from hetjax.errors import ConfigError
from hetjax.mesh import MESH_AXES, MeshConfig
from hetjax.pipeline.config import validate_pipeline, virtual_stages
from hetjax.sharding import check_divisible, check_microbatch_rows
from hetjax.transfer.link import LinkConfig

PLACEMENTS = ("pipeline", "data")
PLATFORMS = ("cpu", "cuda", "rocm")


@dataclasses.dataclass(frozen=True)
class IslandConfig:
    """A homogeneous part of the job: its own platform, jax.distributed world and mesh."""

    name: str = "island"
    platform: str = "cpu"  # cuda | rocm | cpu: the compile profile of this island
    num_processes: int = 1
    devices_per_process: int = 1
    mesh: MeshConfig = MeshConfig()  # over num_processes * devices_per_process devices
    speed: float = 1.0  # relative throughput: data shares and the default layer split

    @property
    def devices(self) -> int:
        """The island's devices, over all of its processes."""
        return self.num_processes * self.devices_per_process


@dataclasses.dataclass(frozen=True)
class HeteroConfig:
    """Islands joined by the transfer primitive (hetjax/hetero); no islands: one mesh."""

    islands: tuple = ()  # IslandConfigs, in pipeline order
    placement: str = "pipeline"  # pipeline: layers split over islands | data: the batch split
    island_layers: tuple = ()  # pipeline: layers per island; (): in proportion to speed
    auto_split: bool = False  # pipeline: measure each island's time per layer, split by that
    link: LinkConfig = LinkConfig(backend="local")  # every link between islands ...
    links: tuple = ()  # ... or one LinkConfig per neighbouring pair (island i, i+1)
    virtual: bool = True  # every island in this process, on a partition of its devices
    fingerprint_every: int = 10  # data placement: check islands hold identical parameters
    timeout_s: float = 120.0  # an island's own jax.distributed start, heartbeat and shutdown


def island_mesh_sizes(island: IslandConfig) -> dict[str, int] | None:
    """The island's mesh axis sizes with -1 resolved; None if they cannot fill its devices."""
    devices = island.devices
    sizes = {a: getattr(island.mesh, a) for a in MESH_AXES}
    known = math.prod(s for s in sizes.values() if s != -1)
    wild = [a for a, s in sizes.items() if s == -1]
    if len(wild) > 1 or any(s == 0 or s < -1 for s in sizes.values()) or devices % known:
        return None
    if wild:
        sizes[wild[0]] = devices // known
    return sizes if math.prod(sizes.values()) == devices else None


def validate_hetero(cfg) -> None:
    """Raises ConfigError for cfg.hetero (cfg: a Config: islands cut its model and batch)."""
    h = cfg.hetero
    if not h.islands:
        for name, unset in (("placement", "pipeline"), ("island_layers", ()), ("auto_split", False)):
            if getattr(h, name) != unset:  # accepted, and ignored
                raise ConfigError(f"config.hetero.{name}={getattr(h, name)!r} without config.hetero.islands: "
                                  f"it places a model on islands, and this config has none; unset it, or "
                                  f"start from an islands config (configs/tiny_hetero.py)")
        return
    n = len(h.islands)
    names = [getattr(i, "name", None) for i in h.islands]
    for k, island in enumerate(h.islands):
        where = f"config.hetero.islands[{k}]"
        if not isinstance(island, IslandConfig):
            raise ConfigError(f"{where}={island!r}: give an IslandConfig(name=..., platform=..., mesh=...)")
        if not island.name or not island.name.replace("-", "").replace("_", "").isalnum():
            raise ConfigError(f"{where}.name={island.name!r}: use letters, digits, - and _ (it names "
                              f"logs, checkpoint folders and transfer tags)")
        if island.name.isdigit() or island.name == CORRUPT_DIR:  # beside a one-mesh job's steps and corrupt/
            raise ConfigError(f"{where}.name={island.name!r}: name an island with a letter in it, and not "
                              f"{CORRUPT_DIR!r} (its checkpoints go in a folder of that name, beside step folders "
                              f"and {CORRUPT_DIR}/)")
        if names.count(island.name) > 1:
            raise ConfigError(f"{where}.name={island.name!r} is used twice; give every island its own name")
        if island.platform not in PLATFORMS:
            raise ConfigError(f"{where}.platform={island.platform!r}: choose one of {PLATFORMS}")
        for key in ("num_processes", "devices_per_process"):
            if not isinstance(getattr(island, key), int) or getattr(island, key) < 1:
                raise ConfigError(f"{where}.{key}={getattr(island, key)!r}: must be a positive integer")
        if not island.speed > 0:
            raise ConfigError(f"{where}.speed={island.speed!r}: must be positive (a relative throughput)")
        if island_mesh_sizes(island) is None:
            devices = island.devices
            raise ConfigError(
                f"{where}.mesh={island.mesh} does not fit the island's {island.num_processes} x "
                f"{island.devices_per_process} = {devices} devices; make the sizes multiply to "
                f"{devices} (one may be -1)")
        if h.placement == "data" and island.mesh.pipeline != 1:
            try:  # the island runs its own pipeline: the same rules as config.mesh.pipeline's,
                # on its share of the batch (placement.batch_shares checks that share)
                validate_pipeline(dataclasses.replace(cfg, mesh=island.mesh), check_batch=False)
            except ConfigError as e:
                raise ConfigError(f"{where}.mesh.pipeline={island.mesh.pipeline}: {e}") from None
            if len(set(cfg.pipeline.stage_layers)) > 1:
                raise ConfigError(
                    f"{where}.mesh.pipeline={island.mesh.pipeline} with uneven config.pipeline.stage_layers="
                    f"{tuple(cfg.pipeline.stage_layers)}: islands exchange gradients in the model's layout, so "
                    f"split the layers evenly inside an island (stage_layers=())")
    if h.placement not in PLACEMENTS:
        raise ConfigError(f"config.hetero.placement={h.placement!r}: choose one of {PLACEMENTS}")
    if cfg.mesh.pipeline not in (1, -1):
        raise ConfigError(f"config.mesh.pipeline={cfg.mesh.pipeline} with config.hetero.islands: "
                          f"each island's mesh is its own (config.hetero.islands[k].mesh)")
    for axis, unset in (("data", 1), ("fsdp", -1), ("tensor", 1)):  # accepted, and ignored
        if getattr(cfg.mesh, axis) != unset:
            raise ConfigError(f"config.mesh.{axis}={getattr(cfg.mesh, axis)} with config.hetero.islands: each island "
                              f"runs on its own mesh (config.hetero.islands[k].mesh), set in the config file; "
                              f"leave config.mesh.{axis} at {unset}")
    if h.placement == "data" and virtual_stages(cfg, n) != 1:
        raise ConfigError(f"config.pipeline.virtual_stages={cfg.pipeline.virtual_stages} with config.hetero."
                          f"placement='data': islands exchange gradients in the model's layout, which "
                          f"interleaved chunks reorder; set virtual_stages=1 or placement='pipeline'")
    if h.placement == "pipeline":
        if n < 2:
            raise ConfigError("config.hetero.placement='pipeline' needs at least 2 islands (one per stage)")
        V = virtual_stages(cfg, n)
        if V != 1 and (h.island_layers or h.auto_split or cfg.model.num_layers % (n * V)):
            raise ConfigError(f"config.pipeline.virtual_stages={V} with config.hetero.placement='pipeline': "
                              f"each of the {n} islands holds {V} equal chunks of layers, so "
                              f"config.model.num_layers={cfg.model.num_layers} must be a multiple of {n * V} "
                              f"and config.hetero.island_layers / auto_split unset; change them or set "
                              f"virtual_stages=1")
        for k, island in enumerate(h.islands):
            if island.mesh.pipeline != 1:
                raise ConfigError(
                    f"config.hetero.islands[{k}].mesh.pipeline={island.mesh.pipeline}: with "
                    f"placement='pipeline' the islands are the stages; set it to 1 (a pipeline "
                    f"inside an island works with placement='data')")
        if h.island_layers and h.auto_split:
            raise ConfigError("config.hetero.island_layers and config.hetero.auto_split both split the "
                              "layers; set only one")
        if h.island_layers and (len(h.island_layers) != n or any(
                not isinstance(x, int) or x < 1 for x in h.island_layers)
                or sum(h.island_layers) != cfg.model.num_layers):
            raise ConfigError(
                f"config.hetero.island_layers={h.island_layers}: give one layer count >= 1 per "
                f"island ({n}) adding up to config.model.num_layers={cfg.model.num_layers}")
        if cfg.optim.grad_accum_steps != 1 or cfg.pipeline.stage_layers:
            raise ConfigError(
                f"config.optim.grad_accum_steps={cfg.optim.grad_accum_steps} / config.pipeline."
                f"stage_layers={cfg.pipeline.stage_layers} with placement='pipeline': the islands are "
                f"the stages; set config.pipeline.microbatches and config.hetero.island_layers instead")
        if cfg.pipeline.microbatches > 0 and cfg.batch_size % cfg.pipeline.microbatches:  # before the rows
            raise ConfigError(f"config.batch_size={cfg.batch_size} is not divisible by "
                              f"config.pipeline.microbatches={cfg.pipeline.microbatches}")
        for k, island in enumerate(h.islands):
            check_microbatch_rows(cfg.batch_size, max(cfg.pipeline.microbatches, 1), cfg.sharding.rules,
                                  island_mesh_sizes(island), f"config.hetero.islands[{k}]'s ")
        if cfg.model.num_layers < n:
            raise ConfigError(f"config.model.num_layers={cfg.model.num_layers} is fewer than the {n} "
                              f"islands of placement='pipeline'; every island needs a layer")
        # Every schedule runs across islands (validate_pipeline checks it against V).
        if cfg.pipeline.schedule.startswith("1f1b") and cfg.pipeline.microbatches < n:
            raise ConfigError(f"config.pipeline.microbatches={cfg.pipeline.microbatches} is below the {n} "
                              f"islands: 1F1B never fills the pipeline; use at least {n}")
    for k, island in enumerate(h.islands):  # (it was refused once built, naming config.mesh, which islands forbid)
        check_divisible({a: d for a, d in cfg.model.dims().items() if a != "layers"}, cfg.sharding.rules,
                        island_mesh_sizes(island), f"config.hetero.islands[{k}].mesh")
    if h.links and len(h.links) != n - 1:
        raise ConfigError(f"config.hetero.links has {len(h.links)} entries for {n} islands: give one "
                          f"LinkConfig per neighbouring pair ({n - 1}), or set config.hetero.link for all")
    # Neighbours use links[k]; every other pair (and every pair without `links`) uses `link`.
    checked = [(f"config.hetero.links[{k}]", link) for k, link in enumerate(h.links)]
    if not h.links or n > 2:
        checked.append(("config.hetero.link", h.link))
    elif isinstance(h.link, LinkConfig):  # serves no pair, but a bad value is still a mistake
        h.link.validate("config.hetero.link")
    for where, link in checked:
        if not isinstance(link, LinkConfig):
            raise ConfigError(f"{where}={link!r}: give a LinkConfig(backend=...)")
        link.validate(where)
        if h.virtual and link.backend != "local":
            raise ConfigError(f"{where}.backend={link.backend!r} with config.hetero.virtual=True: virtual "
                              f"islands share one process, so use 'local'; or run real processes "
                              f"(config.hetero.virtual=False, python -m launch.local)")
        if not h.virtual and link.backend == "local":
            raise ConfigError(f"{where}.backend='local' with config.hetero.virtual=False: islands in "
                              f"separate processes need 'host' or 'direct'")
        if not h.virtual and link.nic_addresses:
            # A process's peers dial the address its host's name resolves to (HETJAX_HOSTS, the
            # SLURM node, the pod), never its own list of NICs, which they cannot know: an
            # endpoint listening on the NICs alone is unreachable, and a live peer looks lost.
            raise ConfigError(f"{where}.nic_addresses={link.nic_addresses!r} with config.hetero.virtual=False: "
                              f"islands find each other's transfer addresses by host name, not by NIC, so "
                              f"the link would listen where no peer dials; leave {where}.nic_addresses unset "
                              f"for islands (NIC striping is for the transfer primitive and "
                              f"hetjax.transfer.probe, whose peers are given explicitly)")
    # links has n - 1 entries (above): with 2 islands the one pair is a neighbour's.
    if h.placement == "data" and n > 2 and h.links and set(h.links) != {h.link}:
        raise ConfigError("config.hetero.links: with placement='data' every island talks to every "
                          "other one; set one config.hetero.link")
    if h.placement == "data":
        if cfg.pipeline.stage_layers and all(island.mesh.pipeline == 1 for island in h.islands):
            raise ConfigError(f"config.pipeline.stage_layers={tuple(cfg.pipeline.stage_layers)} with "
                              f"placement='data' and no island running a pipeline (every island's "
                              f"mesh.pipeline=1): there are no stages to split; unset it")
        if h.island_layers or h.auto_split:
            raise ConfigError(f"config.hetero.island_layers={h.island_layers} / auto_split={h.auto_split} with "
                              f"placement='data': every island holds the whole model, so nothing splits its "
                              f"layers; unset them (or use placement='pipeline')")
    if h.fingerprint_every < 0:
        raise ConfigError(f"config.hetero.fingerprint_every={h.fingerprint_every}: use 0 (off) or a "
                          f"positive step count")
    if cfg.checkpoint.keep < 2:
        raise ConfigError(f"config.checkpoint.keep={cfg.checkpoint.keep} with islands: keep at least 2, "
                          f"so that a step every island finished survives one island dying mid-save")
    if not h.timeout_s > 0:
        raise ConfigError(f"config.hetero.timeout_s={h.timeout_s}: must be positive (seconds)")


def for_processes(h: HeteroConfig, backend: str | None = None) -> HeteroConfig:
    """h with its links as separate processes run them: every one (link and each of links)
    on `backend` when given, else a `local` one on `host` (processes cannot share one)."""
    def one(link):
        if not isinstance(link, LinkConfig):  # validate_hetero names it
            return link
        return dataclasses.replace(link, backend=backend or ("host" if link.backend == "local" else link.backend))
    return dataclasses.replace(h, link=one(h.link), links=tuple(one(link) for link in h.links))


def write_links_config(path, original, links: tuple) -> str:
    """Writes at `path` a config file: the one at `original` with these links' backends (what
    launch.local gives its processes: no --config.KEY=VALUE reaches a LinkConfig in a tuple)."""
    backends, original = tuple(link.backend for link in links), str(Path(original).resolve())
    Path(path).write_text(
        f'"""Written by launch.local: {original} with the backends of the links its processes use."""\n\n'
        f"import dataclasses\n\nfrom hetjax import config\n\n\ndef get_config():\n"
        f"    cfg = config.load({original!r})\n"
        f"    links = tuple(dataclasses.replace(link, backend=b) for link, b in zip(cfg.hetero.links, {backends!r}))\n"
        f"    return dataclasses.replace(cfg, hetero=dataclasses.replace(cfg.hetero, links=links))\n")
    return str(path)
