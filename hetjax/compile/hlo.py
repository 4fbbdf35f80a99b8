"""What a compiled (SPMD-partitioned, per-device) HLO program does in one run, read from its text.

XLA's cost_analysis counts a while loop's body once; our layers are a scanned
loop, so FLOPs, bytes and collectives are counted here by walking the program's
computations with each while loop's known trip count.

Conventions, per device and per step:
- FLOPs: 2 x (result elements) x (contracted elements) for every `dot`.
- Matmul bytes: operands read plus result written by every `dot`: the HBM
  traffic of a GPU program whose elementwise work is fused into its matmuls
  (XLA:CPU fuses less, so counting every CPU instruction would overstate it).
- Collective bytes: what one device sends under ring algorithms, from the
  operand size S and the group size n: all-gather S*(n-1); reduce-scatter and
  all-to-all S*(n-1)/n; all-reduce 2*S*(n-1)/n; collective-permute S.

Bytes are read from the dtypes of the compiled XLA:CPU program, which upcasts bf16
dots to f32 (their operands and results, and so the tensor-parallel all-reduces of
those results). For a bf16 model, matmul bytes and those all-reduce bytes come out
about twice what a GPU moves, which keeps the dots in bf16; FLOPs are unaffected.
"""

from __future__ import annotations

import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b(pred|s4|s8|s16|s32|s64|u4|u8|u16|u32|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64|c64|c128|token)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_WIDTH = {"pred": 1, "s4": 0.5, "u4": 0.5, "token": 0, "f8e4m3fn": 1, "f8e5m2": 1, "s8": 1, "u8": 1,
          "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
          "f64": 8, "c64": 8, "c128": 16}


def shape_bytes(text: str) -> float:
    """Bytes of every array shape written in `text` (a shape or a tuple of shapes)."""
    total = 0.0
    for dtype, dims in _SHAPE.findall(text):
        total += _WIDTH[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _dims(text: str) -> list[int]:
    m = _SHAPE.search(text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def parse(text: str) -> tuple[dict[str, list[tuple]], str]:
    """computation name -> [(name, shape text, opcode, operand names, rest)], and the entry's name."""
    comps: dict[str, list[tuple]] = {}
    entry, current = "", None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("{")[0].split("->")[0].split("(")[0]:
            current = header.group(2)
            comps[current] = []
            if header.group(1):
                entry = current
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            name, shape, opcode, rest = m.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split("),")[0] if ")," in rest else rest)
            comps[current].append((name, shape, opcode, operands, rest))
    return comps, entry


def _group_size(rest: str, devices: int) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if m:
        sizes = dict((k.strip("' "), int(v)) for k, v in (p.split("=") for p in m.group(1).split(",")))
        return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", rest)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return len(m.group(1).split(","))
    return devices  # replica_groups={}: all devices


def summarize(text: str, devices: int) -> dict:
    """FLOPs, matmul bytes and per-kind collective bytes of one run, per device.

    A while loop counts its body `known_trip_count` times; a conditional runs one branch
    per call, so it counts its costliest (by FLOPs): an upper bound, which for a
    pipeline's ticks (one branch per tick and stage) is the lockstep tick's cost."""
    comps, entry = parse(text)
    memo: dict = {}

    def cost(comp: str, fused: bool) -> list:
        """[flops, matmul bytes, {kind: [count, bytes]}] of one call of `comp`."""
        if (comp, fused) in memo:
            return memo[comp, fused]
        flops = matmul_bytes = 0.0
        coll = {k: [0, 0.0] for k in COLLECTIVES}

        def add(sub, times):
            nonlocal flops, matmul_bytes
            flops += times * sub[0]
            matmul_bytes += times * sub[1]
            for k, (n, b) in sub[2].items():
                coll[k][0] += times * n
                coll[k][1] += times * b

        instrs = comps[comp]
        shapes = {name: shape for name, shape, *_ in instrs}
        for _, shape, opcode, operands, rest in instrs:
            # Only dots and collectives need their operands' bytes: most instructions don't.
            operand_bytes = lambda: sum(shape_bytes(shapes.get(o, "")) for o in operands)  # noqa: E731
            if opcode == "dot":
                lhs = _dims(shapes.get(operands[0], ""))
                m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
                contracted = math.prod(lhs[int(i)] for i in m.group(1).split(",") if i) if m and lhs else 1
                flops += 2 * math.prod(_dims(shape)) * contracted
                matmul_bytes += operand_bytes() + shape_bytes(shape)
            kind = opcode.removesuffix("-start")
            if kind in coll and not fused:
                g = _group_size(rest, devices)
                factor = {"all-gather": g - 1, "reduce-scatter": (g - 1) / g, "all-to-all": (g - 1) / g,
                          "all-reduce": 2 * (g - 1) / g, "collective-permute": 1}[kind]
                coll[kind][0] += 1
                coll[kind][1] += operand_bytes() * factor
            m = _TRIP.search(rest) if opcode == "while" else None
            trip = int(m.group(1)) if m else 1
            for k, callee in _CALLS.findall(rest):
                if callee in comps and k not in ("true_computation", "false_computation"):
                    add(cost(callee, fused or opcode == "fusion" or k == "to_apply"),
                        trip if k in ("body", "condition") else 1)
            branches = [c for k, c in _CALLS.findall(rest) if k in ("true_computation", "false_computation")]
            for b in _BRANCHES.findall(rest):
                branches += [c.strip().lstrip("%") for c in b.split(",")]
            branches = [c for c in branches if c in comps]
            if branches:
                add(max((cost(c, fused) for c in branches), key=lambda s: (s[0], s[1])), 1)
        memo[comp, fused] = [flops, matmul_bytes, coll]
        return memo[comp, fused]

    flops, matmul_bytes, coll = cost(entry, False)
    return {"flops": flops, "matmul_bytes": matmul_bytes,
            "collectives": {k: {"count": n, "bytes": b} for k, (n, b) in coll.items()}}
