"""Training time lost per asynchronous checkpoint save, as a share of one step.

    python -m bench.checkpoint_cost [--steps 20] [--every 10] [--rounds 2] [--embed 128]

In one process, with one compiled step, alternates rounds of `steps` training steps
without saves (the baseline) and with an async save every `every` steps through
hetjax.checkpoint.Manager (checksums, the host copy, and orbax's background write
all included; the final wait is counted too). It reports two figures: the time the
loop is blocked inside `Manager.save` (dispatching one program that copies the state
to host memory and hashes it, hetjax/checkpoint_copy.py; waiting for it, the
checksums and orbax's writing happen in a background thread), and the time lost per
save (with saves - without; on a few cores the copy, the hashing and the background
writer compete with the steps for the same cores). The last line is the blocking
share: blocked time per save / the median step of the rounds without saves (target <= 5%).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import jax

from hetjax import checkpoint, data, program
from hetjax.config import CheckpointConfig, Config, MeshConfig, ModelConfig
from hetjax.mesh import make_mesh
from hetjax import cli


def main() -> None:
    p = cli.ArgumentParser(description=__doc__.split("\n")[0],
                           example="python -m bench.checkpoint_cost --steps 20 --every 10")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--embed", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args()
    if args.rounds < 1 or not 1 <= args.every <= args.steps:
        p.error(f"--steps={args.steps} --every={args.every} --rounds={args.rounds}: a round needs a save "
                f"(1 <= every <= steps) and at least one round")
    d = args.embed
    cfg = Config(model=ModelConfig(vocab_size=1024, num_layers=4, embed_dim=d, mlp_dim=3 * d, num_heads=4,
                                   num_kv_heads=2, head_dim=d // 4), mesh=MeshConfig(fsdp=-1),
                 batch_size=args.batch, seq_len=128, steps=10_000)
    mesh = make_mesh(cfg.mesh)
    prog = program.build(cfg, mesh)
    train_step, state = prog.compile_train_step(), prog.init_state()
    dataset = data.build(cfg)
    batches = [dataset.batch(s, prog.batch_shardings) for s in range(args.steps)]
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"{sum(x.size for x in jax.tree.leaves(state.params)):,} parameters, {nbytes / 2**20:.1f} MiB of "
          f"state per checkpoint, on {len(jax.devices())} {jax.devices()[0].platform} device(s)")

    step_times, blocked = [], []

    def run(state, manager, first):
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            t = time.perf_counter()
            state, metrics = train_step(state, batch)
            jax.block_until_ready(metrics)
            if manager is None:  # a step of a saving round shares the cores with the save
                step_times.append(time.perf_counter() - t)
            s = first + i + 1
            if manager is not None and (i + 1) % args.every == 0:  # steps // every saves in every round
                t = time.perf_counter()
                manager.save(s, state, {"step": s}, {})
                blocked.append(time.perf_counter() - t)
        if manager is not None:
            manager.wait()
        return state, time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        manager = checkpoint.Manager(tmp, CheckpointConfig(every=args.every, keep=2))
        state, _ = run(state, manager, 0)  # warm-up: compiles the step and the checksums
        plain, saving, first = [], [], args.steps
        step_times.clear()
        blocked.clear()
        for _ in range(args.rounds):
            state, t = run(state, None, first)
            plain.append(t)
            first += args.steps
            state, t = run(state, manager, first)
            saving.append(t)
            first += args.steps
        manager.close()
    saves = args.steps // args.every
    step_time = statistics.median(step_times)
    lost = (statistics.median(saving) - statistics.median(plain)) / saves
    print(f"per round of {args.steps} steps: {statistics.median(plain):.3f}s without saves, "
          f"{statistics.median(saving):.3f}s with {saves} async saves; median step without saves "
          f"{step_time * 1e3:.1f} ms")
    print(f"time lost per async save (with saves - without): {lost * 1e3:.1f} ms = {lost / step_time:.1%} of a step")
    block = statistics.median(blocked)
    print(f"loop blocked per save (median of {len(blocked)}): {block * 1e3:.1f} ms = "
          f"{block / step_time:.1%} of a step (target <= 5%)")


if __name__ == "__main__":
    main()
