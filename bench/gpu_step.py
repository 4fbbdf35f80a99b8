"""Step time, tokens/s and MFU of a one-GPU Llama, against the device's own matmul rate.

    python -m bench.gpu_step [--remat dots] [--batch 8] [--seq 4096] [--steps 10]
                             [--attention auto|xla|cudnn] [--profile DIR]
    python -m bench.gpu_step --tiny          # a CPU-sized model, to check the path end to end

The model is Llama-3.2-1B's shape (16 layers, embed 2048, mlp 8192, 32 heads,
8 KV heads, vocab 128256; 1.24 B parameters), bf16 compute over fp32 master
weights, AdamW, on a mesh of all local devices (fsdp), with the platform's backend
profile applied first and cuDNN attention on CUDA. It runs hetjax's compiled train
step on batches placed beforehand.

The baseline, in the same run: a bf16 (fp32 on CPU) square matmul, the best the
device does on the op that dominates the model. The last line is the step's
model-FLOP rate (6N + attention per token) over that matmul rate; MFU against
the data-sheet peak is printed above it when the device is in the hardware table.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from hetjax import cli

MODEL_1B = dict(vocab_size=128256, num_layers=16, embed_dim=2048, mlp_dim=8192, num_heads=32,
                num_kv_heads=8, head_dim=64, rope_theta=500_000.0, dtype="bfloat16",
                param_dtype="float32", tie_embeddings=True)
MODEL_TINY = dict(vocab_size=512, num_layers=2, embed_dim=128, mlp_dim=384, num_heads=4,
                  num_kv_heads=2, head_dim=32, dtype="float32", param_dtype="float32")


def matmul_rate(n: int, dtype, repeats: int = 10) -> float:
    """FLOP/s of an n x n matmul chain on the first device (median of repeats)."""
    import jax
    import jax.numpy as jnp
    a = jax.device_put(jnp.ones((n, n), dtype) / n, jax.local_devices()[0])
    f = jax.jit(lambda x: x @ x @ x @ x)  # three matmuls per call: dispatch is negligible
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 3 * 2 * n**3 / statistics.median(times)


def main(argv: list[str]) -> int:
    p = cli.ArgumentParser(description=__doc__.split("\n")[0],
                           example="python -m bench.gpu_step --tiny")
    p.add_argument("--tiny", action="store_true", help="a CPU-sized model and matmul")
    p.add_argument("--remat", default="dots", choices=("none", "full", "dots", "dots_no_batch"))
    p.add_argument("--batch", type=int, help="global batch in sequences (default 8; tiny 8)")
    p.add_argument("--seq", type=int, help="sequence length (default 4096; tiny 128)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attention", choices=("auto", "xla", "cudnn"),
                   help="attention implementation (default cudnn on CUDA, else auto)")
    p.add_argument("--profile", metavar="DIR", help="trace two more steps into DIR and print where "
                   "the device's time went (kernels by kind, the top ones)")
    args = p.parse_args(argv)

    from hetjax import config as config_lib
    from hetjax.compile import backend
    # The profile (XLA flags, NCCL/RCCL env) goes in before jax starts its backends.
    cfg = config_lib.load("tiny")
    platform, _ = backend.detect()
    model = dict(MODEL_TINY if args.tiny else MODEL_1B, remat=args.remat,
                 attention_impl=args.attention or ("cudnn" if platform == "cuda" and not args.tiny else "auto"))
    cfg = dataclasses.replace(
        cfg, name="llama1b" if not args.tiny else "tiny-bench",
        model=dataclasses.replace(cfg.model, **model),
        batch_size=args.batch or 8, seq_len=args.seq or (128 if args.tiny else 4096),
        steps=args.warmup + args.steps, compile=dataclasses.replace(cfg.compile, cache=False))
    config_lib.validate(cfg)
    print(backend.start(cfg), flush=True)  # cache off: the profile only

    import jax
    import jax.numpy as jnp
    from hetjax import data, metrics
    from hetjax import program
    from hetjax.compile import hardware
    from hetjax.mesh import make_mesh

    mesh = make_mesh(cfg.mesh)
    prog = program.build(cfg, mesh)
    train_step, state = prog.compile_train_step(), prog.init_state()
    dataset = data.build(cfg)
    batches = [dataset.batch(s, prog.batch_shardings) for s in range(4)]
    num_params = metrics.num_params(cfg.model)  # not prog.layouts: a pipeline's hold padding
    flops_per_step = metrics.model_flops_per_token(cfg, num_params) * cfg.batch_size * cfg.seq_len
    device = jax.local_devices()[0]
    print(f"{cfg.name}: {num_params / 1e9:.3f} B parameters, batch {cfg.batch_size} x {cfg.seq_len}, "
          f"remat {cfg.model.remat}, attention {cfg.model.attention_impl}, on {mesh.size} x "
          f"{device.device_kind}", flush=True)

    for s in range(args.warmup):
        state, m = train_step(state, batches[s % len(batches)])
    jax.block_until_ready(m)
    times = []
    for s in range(args.steps):
        t = time.perf_counter()
        state, m = train_step(state, batches[s % len(batches)])
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    step_time = statistics.median(times)
    if args.profile:
        from hetjax import profiler
        jax.profiler.start_trace(args.profile, create_perfetto_trace=True)
        for s in range(2):
            with jax.profiler.StepTraceAnnotation("train", step_num=s):
                state, m = train_step(state, batches[s % len(batches)])
        jax.block_until_ready(m)
        jax.profiler.stop_trace()
        print("\n".join(profiler.kernel_summary(args.profile) or ["(no device kernels in the trace)"]))
    model_rate = flops_per_step / step_time / mesh.size  # per device
    n, dtype = (1024, jnp.float32) if args.tiny or device.platform == "cpu" else (8192, jnp.bfloat16)
    base = matmul_rate(n, dtype)
    print(f"step {step_time * 1e3:.1f} ms (median of {args.steps}), "
          f"{cfg.batch_size * cfg.seq_len / step_time:,.0f} tokens/s, loss {float(m['loss']):.3f}")
    print(f"model FLOP/s per device {model_rate / 1e12:.3f} T; baseline {n}x{n} "
          f"{jnp.dtype(dtype).name} matmul {base / 1e12:.3f} TFLOP/s")
    known = hardware.for_device_kind(device.device_kind)
    if known is not None and device.platform != "cpu":
        # MaxText's published MFU counts causal attention at half the FLOPs of PaLM's formula.
        maxtext = model_rate * metrics.maxtext_flops_per_token(cfg) / metrics.model_flops_per_token(cfg, num_params)
        print(f"MFU {model_rate / known.peak_flops:.1%} of the {known.name} bf16 data-sheet peak "
              f"({maxtext / known.peak_flops:.1%} as MaxText counts); the matmul reaches "
              f"{base / known.peak_flops:.1%} of it")
    print(f"step model-FLOP rate / matmul rate: {model_rate / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
