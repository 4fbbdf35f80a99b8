"""Ahead-of-time compilation with abstract inputs, and what the compiler reports."""

from __future__ import annotations

import jax


def abstract(tree, shardings):
    """ShapeDtypeStructs carrying shardings: a stand-in for arrays that were never made."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def compile(jitted, *abstract_args):
    """Lowers and compiles `jitted` for abstract arguments; allocates nothing."""
    return jitted.lower(*abstract_args).compile()


def analysis(compiled) -> dict[str, float]:
    """Per-device bytes and FLOPs, as the compiler reports them."""
    out: dict[str, float] = {}
    mem = compiled.memory_analysis()
    if mem is not None:
        for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                      "temp_size_in_bytes", "generated_code_size_in_bytes"):
            out[field.removesuffix("_size_in_bytes") + "_bytes"] = float(getattr(mem, field, 0))
        # Donated arguments alias outputs: count those bytes once.
        out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"]
                             + out["temp_bytes"])
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    if cost:
        out["flops"] = float(cost.get("flops", 0.0))
        out["bytes_accessed"] = float(cost.get("bytes accessed", 0.0))
    return out
