"""The peak FLOP/s an islands job's MFU is measured against: the whole job's, as its FLOPs
are. Each island reports its own (its device kind's data sheet, config.peak_tflops, or a
measured CPU rate) and the job's is their sum, with a host's measured CPU rate once."""

from __future__ import annotations

import json
import socket

import jax
import numpy as np

from hetjax import metrics as metrics_lib


def island_peak(cfg, devices) -> dict:
    """An island's peak FLOP/s and its source (hetjax.metrics.peak_flops), JSON-able for
    the exchange; `host` names the machine whose cores a measured CPU rate stands for."""
    peak, source = metrics_lib.peak_flops(cfg, devices)
    measured = devices[0].platform == "cpu" and cfg.peak_tflops <= 0
    return {"peak": peak, "source": source, "host": socket.gethostname() if measured else None}


def island_agreed(value) -> dict:
    """Rank 0's JSON-able `value` on every process of this island (its own jax.distributed
    world): a measured CPU rate differs from process to process, and what the island
    sends over its links must be one value, the same on each of them."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils
    text = json.dumps(value, sort_keys=True).encode()
    assert len(text) < 4096, text
    buf = np.zeros(4096, np.uint8)
    buf[:len(text)] = np.frombuffer(text, np.uint8)
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))).rstrip(b"\0").decode())


def peak_of_job(cfg, local_devices: list[list], exchange=None) -> tuple[float, str]:
    """The whole job's peak FLOP/s and its source, as flops_per_step is the whole job's.
    `local_devices`: each island of this process's devices; `exchange(mine)`, in process
    mode (one island here): every island's `mine`, in island order (gather_json)."""
    peaks = [island_peak(cfg, devices) for devices in local_devices]
    if exchange is not None:  # the other islands' peaks come from their own device kinds
        peaks = exchange(peaks[0])
    return job_peak(peaks)


def job_peak(peaks: list[dict]) -> tuple[float, str]:
    """The sum of every island's island_peak, with a host's measured CPU rate counted
    once (its islands share its cores, as virtual CPU devices do in
    metrics.peak_flops), and the sources."""
    hosts: dict[str, float] = {}
    total = 0.0
    for p in peaks:
        if p["host"] is None:
            total += p["peak"]
        else:
            hosts[p["host"]] = max(hosts.get(p["host"], 0.0), p["peak"])
    sources = " + ".join(dict.fromkeys(p["source"] for p in peaks))
    return total + sum(hosts.values()), sources
