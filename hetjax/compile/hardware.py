"""Accelerators the planner and MFU know, as data: one record per device as jax sees it.

Figures are vendors' data-sheet peaks per device: dense bf16 FLOP/s (no sparsity),
HBM bandwidth, and interconnect bandwidth per direction to the other devices of a
node (NVLink / Infinity Fabric). An MI250X shows up in jax as two devices (GCDs),
so its row is half a package.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    vendor: str  # cuda | rocm
    peak_flops: float  # dense bf16, FLOP/s
    hbm_bandwidth: float  # bytes/s
    interconnect_bandwidth: float  # bytes/s per direction, within a node
    memory_bytes: float


GB, GiB = 1e9, 1024**3
TABLE = {h.name: h for h in (
    Hardware("H200", "cuda", 989e12, 4800 * GB, 450 * GB, 141 * GB),
    Hardware("H100", "cuda", 989e12, 3350 * GB, 450 * GB, 80 * GiB),  # SXM
    # The PCIe cards peak lower: jax names them "NVIDIA H100 PCIe" / "NVIDIA H100 NVL" (an
    # NVLink bridge joins pairs of them, 600 GB/s both ways).
    Hardware("H100 PCIe", "cuda", 756e12, 2000 * GB, 300 * GB, 80 * GiB),
    Hardware("H100 NVL", "cuda", 835e12, 3900 * GB, 300 * GB, 94 * GB),
    Hardware("GH200", "cuda", 989e12, 4000 * GB, 450 * GB, 96 * GiB),
    Hardware("B200", "cuda", 2250e12, 8000 * GB, 900 * GB, 180 * GB),
    Hardware("A100", "cuda", 312e12, 2039 * GB, 300 * GB, 80 * GiB),
    Hardware("L40S", "cuda", 362e12, 864 * GB, 32 * GB, 48 * GiB),  # PCIe 4.0 x16, no NVLink
    Hardware("MI325X", "rocm", 1307e12, 6000 * GB, 448 * GB, 256 * GiB),
    Hardware("MI300X", "rocm", 1307e12, 5300 * GB, 448 * GB, 192 * GiB),
    Hardware("MI250X", "rocm", 191.5e12, 1638 * GB, 200 * GB, 64 * GiB),  # one GCD
    Hardware("MI210", "rocm", 181e12, 1638 * GB, 150 * GB, 64 * GiB),
)}

# What the planner estimates for when no --hardware is named.
DEFAULT_HARDWARE = ("H100", "A100", "MI250X", "MI300X")


def for_device_kind(kind: str) -> Hardware | None:
    """The record whose name is in jax's `device_kind` (case-insensitive); the longest such
    name, so that "NVIDIA GH200 480GB" is a GH200, not an H200."""
    found = [hw for name, hw in TABLE.items() if name.lower() in kind.lower()]
    return max(found, key=lambda hw: len(hw.name), default=None)


def get(name: str) -> Hardware:
    """The record for `name` (case-insensitive), or a ConfigError listing the known ones."""
    from hetjax.errors import ConfigError
    for key, hw in TABLE.items():
        if key.lower() == name.lower():
            return hw
    raise ConfigError(f"--hardware={name!r}: unknown accelerator; known: {', '.join(TABLE)}")
