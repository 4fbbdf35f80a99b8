"""The global batches are the same for 1, 2 and 4 real jax.distributed processes.

Each process (8 CPU devices shared among the processes, gloo collectives) builds
the batches of steps 0..2 on a data=4 x fsdp=2 mesh and writes the rows its
devices hold and the rows it read; the parent compares them with the packed
rows computed here in one process. All 7 processes run at once. Each also does the
same for a mixture of two JSONL sources (config.data.mixture).
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
STEPS = 3


def config(mix_dir: str = ""):
    from hetjax.config import Config, DataConfig, MeshConfig, ModelConfig
    if mix_dir:
        mix = tuple((n, w, "jsonl", f"{mix_dir}/{n}.jsonl") for n, w in (("a", 2.0), ("b", 1.0)))
        return Config(model=ModelConfig(vocab_size=320), mesh=MeshConfig(data=4, fsdp=2), batch_size=8,
                      seq_len=16, data=DataConfig(seed=11, mixture=mix, index_dir=f"{mix_dir}/ix"))
    return Config(model=ModelConfig(vocab_size=64), mesh=MeshConfig(data=4, fsdp=2), batch_size=8,
                  seq_len=16, data=DataConfig(seed=11, mean_doc_length=12, num_documents=300))


def write_mixture(directory) -> None:
    for name, n in (("a", 40), ("b", 25)):
        (directory / f"{name}.jsonl").write_text("".join(f'{{"text": "{name} document {i} {"x" * (i % 13)}"}}\n'
                                                         for i in range(n)))


def worker(process_id: int, num_processes: int, port: int, out: str) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // num_processes}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
    from hetjax import data, program
    from hetjax.mesh import make_mesh
    for prefix, cfg in (("", config()), ("mix", config(os.path.dirname(out)))):
        d = data.build(cfg)
        sh = program.batch_shardings(make_mesh(cfg.mesh), cfg.sharding.rules)
        it = d.iterator(sh)
        saved = {}
        for s in range(STEPS):
            batch = next(it)
            saved[f"read_{s}"] = it.last_rows[0]
            for k, arr in batch.items():
                for j, shard in enumerate(arr.addressable_shards):
                    rows = np.arange(8)[shard.index[0]]
                    saved[f"{k}_{s}_{j}_rows"] = rows
                    saved[f"{k}_{s}_{j}"] = np.asarray(shard.data)
        it.close()
        np.savez(out.replace(".npz", f"{prefix}.npz"), **saved)
    jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_global_batches_are_the_same_for_1_2_and_4_processes(tmp_path):
    from hetjax import data
    write_mixture(tmp_path)
    mixed = data.build(config(str(tmp_path)))  # builds the text index the processes share
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
    procs = []
    for n in (1, 2, 4):
        port = free_port()
        for pid in range(n):
            out = tmp_path / f"n{n}_p{pid}.npz"
            procs.append((n, pid, out, subprocess.Popen(
                [sys.executable, __file__, str(pid), str(n), str(port), str(out)], cwd=ROOT, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for n, pid, out, p in procs:
        try:
            log, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for *_, q in procs:
                q.kill()
            raise AssertionError(f"process {pid} of {n} did not finish in 240 s")
        assert p.returncode == 0, f"process {pid} of {n}:\n{log[-3000:]}"

    for (n, prefix), d in {(n, p): d for n in (1, 2, 4) for p, d in (("", data.build(config())), ("mix", mixed))}.items():
        held = {s: set() for s in range(STEPS)}
        for pid in range(n):
            got = np.load(tmp_path / f"n{n}_p{pid}{prefix}.npz")
            for s in range(STEPS):
                expected = d.train.rows(np.arange(s * 8, s * 8 + 8))
                mine = set()
                for key in got.files:
                    if key.endswith("_rows") or key.startswith("read_"):
                        continue
                    name, key_step, _ = key.rsplit("_", 2)
                    if int(key_step) != s:
                        continue
                    rows = got[key + "_rows"]
                    np.testing.assert_array_equal(got[key], expected[name][rows], err_msg=(n, pid, key))
                    mine.update(rows.tolist())
                # The process read exactly the rows its devices hold, no others.
                assert sorted(mine) == sorted(got[f"read_{s}"] - s * 8), (n, pid, s)
                held[s] |= mine
        assert all(h == set(range(8)) for h in held.values()), (n, held)
        if n == 4:
            assert len(mine) == 2  # with 4 processes each one reads a quarter of the batch


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
