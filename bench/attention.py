"""Attention over packed documents, forward + backward: XLA against cuDNN on one GPU.

    python -m bench.attention [--batch 8] [--seq 4096] [--heads 32] [--kv-heads 8]
                              [--head-dim 64] [--mean-doc 512] [--iters 10]

The shape defaults to bench.gpu_step's (Llama-3.2-1B, bf16). Each row holds documents
of random lengths (mean --mean-doc tokens), and a token attends causally within its
own document only. Variants, each timed as one jitted forward + backward:

  xla           jax.nn.dot_product_attention(implementation="xla"), the (B, 1, T, T) mask
  cudnn         the same call with implementation="cudnn" (hetjax's attention_impl=cudnn):
                cuDNN turns the mask into an additive bias it reads in both passes
  packed_M      models.llama.cudnn_packed_attention: cuDNN's packed layout, each row's
                document starts and lengths with room for M documents (--max-documents;
                the fullest row's count is always one of them)
  cudnn_causal  one document per row (plain causal), for scale

Each variant's output and gradients are compared with xla's in fp32. The last line is
xla's time over cudnn's (hetjax's cudnn path). On a machine without a GPU it
runs the xla variant alone on CPU at --tiny size, to check the path.
"""

from __future__ import annotations

import statistics
import sys
import time


def documents(key, batch: int, seq: int, mean_doc: int):
    """(batch, seq) int32 segment ids: runs of random lengths (geometric, mean_doc)."""
    import jax
    import jax.numpy as jnp
    starts = jax.random.bernoulli(key, 1.0 / mean_doc, (batch, seq)).at[:, 0].set(True)
    return jnp.cumsum(starts, axis=1).astype(jnp.int32)


def variants(bounds):
    """name -> attention(q, k, v, segment_ids) for each variant the docstring lists."""
    import jax
    from hetjax.models.llama import cudnn_packed_attention

    def masked(impl):
        def f(q, k, v, seg):
            mask = seg[:, None, :, None] == seg[:, None, None, :]  # (B, 1, T, T)
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation=impl)
        return f

    def packed(m):
        return lambda q, k, v, seg: cudnn_packed_attention(q, k, v, seg, m)

    def causal(q, k, v, seg):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    return {"xla": masked("xla"), "cudnn": masked("cudnn"), **{f"packed_{m}": packed(m) for m in bounds},
            "cudnn_causal": causal}


def main(argv: list[str]) -> int:
    from hetjax import cli
    p = cli.ArgumentParser(description=__doc__.split("\n")[0], example="python -m bench.attention --tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mean-doc", type=int, default=512)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--max-documents", default="32,64", help="packed_M variants' M, comma-separated "
                   "(on an H200, 256 asks 130 GiB)")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized shape")
    args = p.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    gpu = jax.devices()[0].platform == "gpu"
    if args.tiny or not gpu:  # the default shape's fp32 scores alone are 17 GiB: a GPU's size
        args.batch, args.seq, args.heads, args.kv_heads, args.mean_doc = 2, 256, 4, 2, 64
    B, T, N, K, H = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    kq, kk, kv, ko, ks = jax.random.split(jax.random.key(0), 5)
    dtype = jnp.bfloat16 if gpu else jnp.float32
    q = jax.random.normal(kq, (B, T, N, H), dtype)  # (batch, length, heads, head_dim)
    k = jax.random.normal(kk, (B, T, K, H), dtype)
    v = jax.random.normal(kv, (B, T, K, H), dtype)
    dout = jax.random.normal(ko, (B, T, N, H), dtype)
    seg = documents(ks, B, T, args.mean_doc)
    most = int(jnp.max(seg[:, -1]))  # documents in the fullest row
    print(f"attention B={B} T={T} N={N} K={K} H={H} {jnp.dtype(dtype).name} on {jax.devices()[0].device_kind}; "
          f"documents per row up to {most} (mean length {args.mean_doc})", flush=True)
    fns = variants(sorted({max(most, 2), *map(int, args.max_documents.split(","))}))
    if not gpu:
        fns = {"xla": fns["xla"]}

    def fwd_bwd(f):
        def loss(q, k, v):
            return jnp.sum(f(q, k, v, seg).astype(jnp.float32) * dout.astype(jnp.float32))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

    results, ref = {}, None
    for name, f in fns.items():
        step = fwd_bwd(f)
        try:
            out = jax.block_until_ready(step(q, k, v))
        except Exception as e:  # a variant this cuDNN or GPU does not support
            print(f"{name:13s} failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
            continue
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            jax.block_until_ready(step(q, k, v))
            times.append(time.perf_counter() - t)
        grads = [np.asarray(g, np.float32) for g in out[1]]
        if ref is None:
            ref = grads
        err = max(float(np.abs(g - r).max() / (np.abs(r).max() + 1e-30)) for g, r in zip(grads, ref))
        results[name] = (statistics.median(times), err)
        print(f"{name:13s} {results[name][0] * 1e3:8.2f} ms fwd+bwd; gradients vs xla: max |diff| / max |xla| "
              f"{err:.2e}", flush=True)
    # bf16 inputs: a correct kernel lands within a few bf16 ulps of XLA's result (2^-8 = 3.9e-3).
    if "cudnn" not in results or results["cudnn"][1] > 2e-2:
        print("xla / cudnn fwd+bwd time: n/a (no GPU here, or cudnn failed above)")
        return 0
    print(f"xla / cudnn fwd+bwd time: {results['xla'][0] / results['cudnn'][0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
