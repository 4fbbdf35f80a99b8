"""Checks that need a CUDA GPU; each skips where none is (CI has none).

The suite's own process runs on 8 virtual CPU devices (conftest.py), so every GPU check
runs in a child process with JAX_PLATFORMS=cuda:
- cuDNN attention over packed documents gives the XLA path's loss and gradients, and
  the documents' masking is what it computes (not plain causal attention);
- the cuda profile's flags are accepted, and in deterministic mode a run repeats bit for
  bit, with the profile's performance flags and with them turned off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetjax.compile import backend
from hetjax.compile import profiles
from hetjax.repro import check
from hetjax.repro import compare as compare_lib

ROOT = Path(__file__).resolve().parent.parent


def _gpu_env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # No preallocation: these children are small and may run beside other GPU programs.
    return {**env, "JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "PYTHONPATH": check.python_path(), **extra}


def _has_gpu() -> bool:
    if backend.unavailable("cuda"):
        return False
    probe = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices('cuda')))"],
                           env=_gpu_env(), capture_output=True, text=True, timeout=300)
    return probe.returncode == 0 and int(probe.stdout.split()[-1]) > 0


pytestmark = pytest.mark.skipif(not _has_gpu(), reason="no CUDA GPU here (jax's cuda plugin or a device)")

ATTENTION = """
import json, jax, jax.numpy as jnp, numpy as np
from flax import nnx
from hetjax.config import ModelConfig
from hetjax.models.llama import Decoder
from hetjax import step

B, T, V = 4, 512, 512
key = jax.random.key(0)
starts = jax.random.bernoulli(key, 1 / 64, (B, T)).at[:, 0].set(True)  # documents of ~64 tokens
segment_ids = jnp.cumsum(starts, axis=1).astype(jnp.int32)
index = jnp.broadcast_to(jnp.arange(T), (B, T))
doc_start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
tokens = jax.random.randint(jax.random.key(1), (B, T + 1), 0, V)
batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "positions": index - doc_start,
         "segment_ids": segment_ids, "loss_mask": jnp.ones((B, T), jnp.int32)}
one_doc = dict(batch, segment_ids=jnp.ones((B, T), jnp.int32), positions=index)

def loss_and_grads(impl, batch):
    cfg = ModelConfig(vocab_size=V, num_layers=2, embed_dim=256, mlp_dim=512, num_heads=4,
                      num_kv_heads=2, head_dim=64, dtype="bfloat16", param_dtype="float32",
                      attention_impl=impl)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))  # the same weights for every impl
    def mean_loss(params):
        total, count = step.loss_sums(params, graphdef, batch)
        return total / count
    loss, grads = jax.jit(jax.value_and_grad(mean_loss))(params)
    return float(loss), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]

xla_loss, xla_grads = loss_and_grads("xla", batch)
cudnn_loss, cudnn_grads = loss_and_grads("cudnn", batch)
causal_loss, causal_grads = loss_and_grads("cudnn", one_doc)
gap = lambda a, b: max(float(np.linalg.norm(x - y) / np.linalg.norm(y)) for x, y in zip(a, b))
print(json.dumps(dict(xla=xla_loss, cudnn=cudnn_loss, one_doc=causal_loss, grad_gap=gap(cudnn_grads, xla_grads),
                      one_doc_grad_gap=gap(causal_grads, xla_grads), kind=jax.devices()[0].device_kind)))
"""


def test_cudnn_attention_over_packed_documents_gives_the_xla_loss_and_gradients():
    proc = subprocess.run([sys.executable, "-c", ATTENTION], env=_gpu_env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    # bf16 activations: two correct kernels differ by their accumulation order. On an H200
    # the losses were 5.5e-6 apart (relative) and the gradients' norms 1.0e-2 at most.
    assert abs(r["cudnn"] - r["xla"]) <= 5e-5 * abs(r["xla"]), r
    assert r["grad_gap"] <= 3e-2, r
    # The documents' masking matters: ignoring it moved the loss by 2.4e-4 and the
    # gradients by 1.2, far past both bounds.
    assert abs(r["one_doc"] - r["xla"]) > 5e-5 * abs(r["xla"]), r
    assert r["one_doc_grad_gap"] > 5 * max(r["grad_gap"], 2e-3), r


def _train(run_dir: Path, xla_flags: str = "") -> tuple[Path, str]:
    cmd = [sys.executable, "-m", "hetjax.train", "--config", "configs/tiny.py", "--config.steps=12",
           "--config.compile.deterministic=True", "--config.compile.cache=False", "--config.eval_every=0",
           "--config.fingerprint_every=4", "--config.log_every=1", f"--config.run_dir={run_dir}"]
    env = _gpu_env(**({"XLA_FLAGS": xla_flags} if xla_flags else {}))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "backend profile cuda-deterministic" in proc.stdout, proc.stdout[:2000]
    return run_dir, next(line for line in proc.stdout.splitlines() if "XLA_FLAGS:" in line)


def test_deterministic_runs_repeat_bit_for_bit_with_and_without_the_profiles_flags(tmp_path):
    a, _ = _train(tmp_path / "a")
    b, _ = _train(tmp_path / "b")
    r = compare_lib.compare(a, b, 0.0, 0.0)
    assert r.identical and r.digests_equal, compare_lib.describe(r)
    # The profile's six switches (scheduling, pipelined collectives, the priority stream)
    # turned off by the user's XLA_FLAGS, which win over the profile's: the same numbers.
    # (Its three collective-combining thresholds stay: one GPU has no collectives to combine.)
    names = [f.split("=", 1)[0] for f in profiles.get("cuda").xla_flags if f.endswith("=true")]
    assert len(names) == 6, names
    c, flags = _train(tmp_path / "c", " ".join(f"{n}=false" for n in names))
    for n in names:  # the user's value took effect, not the profile's
        assert f"{n}=false" in flags and f"{n}=true" not in flags, flags
    r = compare_lib.compare(a, c, 0.0, 0.0)
    print(compare_lib.describe(r))
    assert r.identical and r.digests_equal, compare_lib.describe(r)
