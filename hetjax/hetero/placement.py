"""Where the work goes: contiguous layers per island (pipeline placement) or rows of
the global batch per island (data placement), from speeds or from a measurement."""

from __future__ import annotations

import numpy as np

from hetjax import sharding
from hetjax.errors import ConfigError
from hetjax.hetero.config import island_mesh_sizes


def proportional(total: int, weights, units=None, what: str = "") -> tuple[int, ...]:
    """Splits `total` into integer parts near weights/sum(weights), part k a positive
    multiple of units[k]: the closest such split (the least sum of |part - ideal|), and of
    equally close ones the largest remainder's; ConfigError if none fits."""
    weights = np.asarray(weights, float)
    units = np.ones(len(weights), int) if units is None else np.asarray(units, int)
    ideal = total * weights / weights.sum()
    parts = np.maximum(units, np.floor(ideal / units).astype(int) * units)
    while parts.sum() > total:  # the minimums overshot: shrink the most over-served part
        over = [k for k in range(len(parts)) if parts[k] > units[k]]
        if not over:
            break
        k = max(over, key=lambda k: parts[k] - ideal[k])
        parts[k] -= units[k]
    for _ in range(int(total)):  # hand out what is left, largest shortfall first
        left = total - parts.sum()
        fits = [k for k in range(len(parts)) if units[k] <= left]
        if left == 0 or not fits:
            break
        k = max(fits, key=lambda k: ideal[k] - parts[k])
        parts[k] += units[k]
    # The hand-out stops once what is left is below the units that would take it, so it can
    # miss a split that exists, or settle for a worse one than exists (16 rows at 1:2 in
    # units of 1 and 4: 8 + 8, not 4 + 12): search for one strictly closer (ties keep the
    # hand-out's, so the splits it found stay as they were).
    cost = float(np.abs(parts - ideal).sum()) if parts.sum() == total else np.inf
    closer = _closest_split(int(total), ideal, [int(u) for u in units], cost - 1e-9 * max(1.0, total))
    if closer is not None or cost == np.inf:
        parts = closer
    if parts is None:
        raise ConfigError(
            f"{what}: {total} cannot be split over the islands in positive multiples of "
            f"{tuple(int(u) for u in units)}; change the total or the islands' meshes")
    return tuple(int(p) for p in parts)


def _closest_split(total: int, ideal, units: list[int], below: float = np.inf) -> list[int] | None:
    """The split of `total` into positive multiples of `units` nearest `ideal` (the least
    sum of |part - ideal|) if that sum is under `below`, else None (also when there is no
    split): a search over the reachable sums."""
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for k, u in enumerate(units):
        rest = sum(units[k + 1:])  # each later island still needs at least its unit
        step: dict[int, tuple[float, list[int]]] = {}
        for reached, (cost, parts) in best.items():
            high = total - reached - rest
            if k == len(units) - 1:  # the last part is what is left: only it can reach `total`
                low = high
            else:  # a part further than `below` from its ideal cannot give a closer split
                slack = below - cost
                low = max(u, -(-int(np.floor(ideal[k] - slack)) // u) * u) if slack < np.inf else u
                high = min(high, int(np.floor(ideal[k] + slack))) if slack < np.inf else high
            for part in range(low, high + 1, u):
                c = cost + abs(part - ideal[k])
                if part % u == 0 and c < below and c < step.get(reached + part, (np.inf,))[0]:
                    step[reached + part] = (c, parts + [part])
        best = step
    return best[total][1] if total in best else None


def island_layers(cfg, speeds=None) -> tuple[int, ...]:
    """Layers per island for placement='pipeline': config.hetero.island_layers, else in
    proportion to `speeds` (measured) or the islands' configured speed weights."""
    h = cfg.hetero
    if h.island_layers:
        return tuple(h.island_layers)
    weights = speeds if speeds is not None else [i.speed for i in h.islands]
    return proportional(cfg.model.num_layers, weights, what="config.model.num_layers")


def batch_shares(cfg) -> tuple[tuple[int, int], ...]:
    """(first row, rows) of the global batch per island for placement='data': in
    proportion to speed, each share a multiple of what the island's mesh splits rows into."""
    units = []
    for island in cfg.hetero.islands:
        sizes = island_mesh_sizes(island)
        # Rows split over the mesh axes config.sharding.rules map `batch` to (data x fsdp by
        # default), and then into micro-batches (the island's pipeline or gradient accumulation).
        micro = cfg.pipeline.microbatches if sizes["pipeline"] > 1 else cfg.optim.grad_accum_steps
        units.append(sharding.shards(dict(cfg.sharding.rules).get("batch"), sizes) * micro)
    rows = proportional(cfg.batch_size, [i.speed for i in cfg.hetero.islands], units,
                        what=f"config.batch_size={cfg.batch_size}")
    starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
    return tuple((int(s), int(n)) for s, n in zip(starts, rows))


def balance(seconds_per_layer) -> list[float]:
    """Speeds from measured seconds per layer (placement='pipeline', auto_split)."""
    return [1.0 / max(t, 1e-9) for t in seconds_per_layer]
