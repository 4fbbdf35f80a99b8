"""config.pipeline: the micro-batch schedule over the `pipeline` mesh axis, and its checks."""

from __future__ import annotations

import dataclasses

from hetjax.errors import ConfigError

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "1f1b_fused")
VIRTUAL_SCHEDULES = ("gpipe", "1f1b_fused")  # the schedules that run interleaved stages


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Micro-batch schedule over the `pipeline` mesh axis (used when config.mesh.pipeline > 1)."""

    # gpipe | 1f1b | 1f1b_fused (see hetjax/pipeline/schedule.py). 1f1b_fused by measurement
    # (bench/pipeline_bubble.py, README): as fast as gpipe at 4 micro-batches and the fastest
    # at 8, with a stash bounded in the stages; the lockstep classic 1f1b was the slowest.
    schedule: str = "1f1b_fused"
    microbatches: int = 4  # the global batch is split into this many micro-batches
    stage_layers: tuple = ()  # layers per stage, e.g. (3, 5); () splits num_layers evenly
    # V > 1: each stage holds V interleaved chunks of layers, a bubble about 1/V as long
    # when microbatches is a multiple of the stages (the last M mod S go round alone); 1: none.
    # 0 (automatic): 2 in the one-program pipeline wherever 2 can run and gains
    # (virtual_stages() below), else 1. By measurement: bench/pipeline_bubble.py, README.
    virtual_stages: int = 0
    # False: in the one-program pipeline a stage's (chunk's) layers are written out one
    # after the other instead of scanned: measured faster (bench/pipeline_bubble.py,
    # README). True compiles faster when a stage holds many layers. The losses are the same.
    # Islands' stage programs scan either way (unrolling measured no faster there).
    scan_layers: bool = False
    # Islands (pipeline placement): False keeps each forward's residuals on its island
    # until its backward, which then need not run the forward again (measured faster:
    # docs/measurements.md, "The first island's second forward, removed"); True recomputes
    # from the stashed stage input, holding only that input per micro-batch in flight. The
    # one-program pipeline always recomputes: keeping residuals in its tick loop's carry
    # measured 1.4-1.7x slower (docs/DESIGN.md). The losses are the same.
    recompute: bool = False
    # Islands (pipeline placement): True splits each backward into its input-gradient part,
    # which the previous island waits for, and its weight-gradient part, which runs where the
    # island would otherwise wait (zero-bubble style, ZB-H1: hetjax/pipeline/split.py,
    # schedule.split_orders). The losses match the whole backwards' within float rounding,
    # not bit for bit, hence off by default; config.model.remat does not apply in a split stage.
    split_backward: bool = False


def virtual_stages(cfg, stages: int) -> int:
    """The chunks per stage that cfg's pipeline of `stages` stages runs: config.pipeline.
    virtual_stages when given (> 0), else 2 where interleaving can run and shortens the
    bubble: a one-program pipeline (islands run 1) of a schedule that interleaves, layers
    that split evenly into 2 x stages chunks, and micro-batches in whole groups of stages.
    Elsewhere 1, as for stages=-1 (config.mesh.pipeline=-1 is decided on the mesh, which
    counts the stages: hetjax.pipeline.spmd.make_plan)."""
    p = cfg.pipeline
    if p.virtual_stages > 0:
        return p.virtual_stages
    gains = (not cfg.hetero.islands and stages > 1 and p.schedule in VIRTUAL_SCHEDULES and not p.stage_layers
             and cfg.model.num_layers % (2 * stages) == 0 and p.microbatches % stages == 0)
    return 2 if gains else 1


def resolve(cfg, stages: int):
    """cfg with config.pipeline.virtual_stages as its pipeline of `stages` stages runs it."""
    V = virtual_stages(cfg, stages)
    return cfg if V == cfg.pipeline.virtual_stages else dataclasses.replace(
        cfg, pipeline=dataclasses.replace(cfg.pipeline, virtual_stages=V))


def check_grad_sync(cfg, pipelined: str) -> None:
    """Refuses config.sharding.grad_sync='once' for a pipeline (`pipelined` says which, or is
    empty): only the unpipelined step sums its data shards' gradients once."""
    if cfg.sharding.grad_sync == "once" and pipelined:
        raise ConfigError(f"config.sharding.grad_sync='once' with {pipelined}: a pipeline's stages sum their "
                          f"gradients where XLA puts them; set config.sharding.grad_sync='per_layer'")


def validate_pipeline(cfg, check_batch: bool = True) -> None:
    """Raises ConfigError unless cfg.pipeline fits cfg.mesh.pipeline stages (cfg: a Config);
    check_batch=False leaves cfg.batch_size alone (an island's share of it is checked apart)."""
    p, stages = cfg.pipeline, cfg.mesh.pipeline
    if p.schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"config.pipeline.schedule={p.schedule!r}: choose one of {PIPELINE_SCHEDULES}")
    if p.microbatches <= 0:
        raise ConfigError(f"config.pipeline.microbatches={p.microbatches}: must be positive")
    if p.split_backward and not (cfg.hetero.islands and cfg.hetero.placement == "pipeline"):
        raise ConfigError(
            "config.pipeline.split_backward=True: only islands with pipeline placement split their backwards "
            "(each island runs its own order of operations; the one-program pipeline's stages move in lockstep "
            "ticks, where the weight-gradient parts would not fill the waits); set it False here")
    # (pipeline=-1 is counted on the mesh: program.check_splits refuses it there)
    check_grad_sync(cfg, f"config.mesh.pipeline={stages}" if stages > 1 else (
        "config.hetero.placement='pipeline'" if cfg.hetero.islands and cfg.hetero.placement == "pipeline" else ""))
    if not isinstance(p.virtual_stages, int) or p.virtual_stages < 0:
        raise ConfigError(f"config.pipeline.virtual_stages={p.virtual_stages!r}: must be an integer >= 0 "
                          f"(0: automatic, 1: no interleaving)")
    V = virtual_stages(cfg, stages)
    if V > 1 and p.schedule not in VIRTUAL_SCHEDULES:
        raise ConfigError(f"config.pipeline.virtual_stages={V} with config.pipeline.schedule={p.schedule!r}: "
                          f"interleaved stages run with {' or '.join(VIRTUAL_SCHEDULES)}; set "
                          f"virtual_stages=1 or change the schedule")
    if stages == 1:
        if V > 1 and not cfg.hetero.islands:  # islands check V against their own placement
            raise ConfigError(f"config.pipeline.virtual_stages={V} with config.mesh.pipeline=1: interleaved "
                              f"chunks need pipeline stages; set config.mesh.pipeline > 1 or virtual_stages=1")
        return
    if stages == -1 and not p.stage_layers:  # the stages are counted on the mesh (spmd.make_plan)
        return
    check_no_grad_accum(cfg, len(p.stage_layers) or stages)
    if V > 1 and p.stage_layers:
        raise ConfigError(f"config.pipeline.stage_layers={p.stage_layers} with config.pipeline.virtual_stages="
                          f"{V}: interleaved chunks split the layers evenly; set stage_layers=()")
    if V > 1 and cfg.model.num_layers % (V * max(stages, 1)):
        raise ConfigError(
            f"config.model.num_layers={cfg.model.num_layers} does not split into config.mesh.pipeline="
            f"{stages} stages x config.pipeline.virtual_stages={V} equal chunks; use a multiple of "
            f"{V * max(stages, 1)} layers or fewer virtual stages")
    if p.stage_layers:
        if stages != -1 and len(p.stage_layers) != stages:
            raise ConfigError(
                f"config.pipeline.stage_layers={p.stage_layers} names {len(p.stage_layers)} stages "
                f"but config.mesh.pipeline={stages}; give one layer count per stage")
        if any(not isinstance(n, int) or n < 1 for n in p.stage_layers):
            raise ConfigError(f"config.pipeline.stage_layers={p.stage_layers}: every stage needs >= 1 layer")
        if sum(p.stage_layers) != cfg.model.num_layers:
            raise ConfigError(
                f"config.pipeline.stage_layers={p.stage_layers} adds up to {sum(p.stage_layers)} "
                f"layers but config.model.num_layers={cfg.model.num_layers}; make them add up")
        stages = len(p.stage_layers)
    elif cfg.model.num_layers % stages:
        raise ConfigError(
            f"config.model.num_layers={cfg.model.num_layers} does not split evenly into "
            f"config.mesh.pipeline={stages} stages; set config.pipeline.stage_layers (e.g. an "
            f"uneven split adding up to {cfg.model.num_layers}) or change the number of stages")
    if p.schedule.startswith("1f1b") and p.microbatches < stages:
        raise ConfigError(
            f"config.pipeline.microbatches={p.microbatches} is smaller than the {stages} pipeline "
            f"stages: 1F1B never fills the pipeline; use at least {stages} micro-batches, or "
            f"config.pipeline.schedule='gpipe'")
    if check_batch and cfg.batch_size % p.microbatches:
        raise ConfigError(
            f"config.batch_size={cfg.batch_size} is not divisible by config.pipeline.microbatches="
            f"{p.microbatches}; make the batch a multiple of the micro-batch count")


def check_no_grad_accum(cfg, stages: int) -> None:
    """Gradient accumulation is refused beside pipeline stages (the pipelined step would ignore it)."""
    if cfg.optim.grad_accum_steps != 1:  # -1 too
        raise ConfigError(
            f"config.optim.grad_accum_steps={cfg.optim.grad_accum_steps} with config.mesh.pipeline="
            f"{cfg.mesh.pipeline} ({stages} stages): the pipeline already splits the batch; set "
            f"config.pipeline.microbatches instead")
