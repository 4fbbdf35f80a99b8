#!/usr/bin/env bash
# Every GPU check and figure of the README's "On a GPU" section, in one run on a machine
# with one CUDA GPU (a lent H100 or H200 is short of time, not of work: one run does all).
#
#   bash bench/gpu_checks.sh [OUT_DIR] [SECONDS]
#
# Each check runs under its own time limit, cut to what is left of SECONDS (default 420),
# so the run ends on time with a summary. Every check's whole output is kept in
# OUT_DIR/logs.tgz; this script prints each one's tail.
set -u
out=$(realpath -m "${1:-$(dirname "$0")/../runs/gpu_checks}")
cd "$(dirname "$0")/.." || exit
budget=${2:-420}
mkdir -p "$out"
work=$(mktemp -d)
deadline=$(( $(date +%s) + budget - 15 ))
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HETJAX_TRANSFER_SECRET=${HETJAX_TRANSFER_SECRET:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}

# check NAME LIMIT_S LINES COMMAND...: runs COMMAND into $work/NAME.log, prints its last LINES lines.
check() {
  local name=$1 limit=$2 lines=$3 start rc left
  shift 3
  left=$(( deadline - $(date +%s) ))
  if (( left < 20 )); then echo "=== $name: skipped, no time left"; return; fi
  (( limit > left )) && limit=$left
  echo "=== $name (limit ${limit} s): $*"
  start=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$work/$name.log" 2>&1
  rc=$?
  tail -n "$lines" "$work/$name.log"
  echo "=== $name: exit $rc after $(( $(date +%s) - start )) s"
}

# Losses per step of two runs, and the transfer times the islands logged.
compare_losses() {
  python - "$@" <<'EOF'
import glob, json, statistics, sys
def rows(d):
    with open(f"{d}/metrics.jsonl") as f:
        return [json.loads(l) for l in f]
try:
    ref = {r["step"]: r["loss"] for r in rows(sys.argv[1]) if "loss" in r}
except OSError as e:
    sys.exit(f"no reference run: {e}")
for run in sys.argv[2:]:
    try:
        rs = rows(run)
    except OSError as e:
        print(f"{run}: no metrics ({e})")
        continue
    got = {r["step"]: r["loss"] for r in rs if "loss" in r}
    common = [s for s in ref if s in got]
    if not common:
        print(f"{run}: no step in common with {sys.argv[1]}")
        continue
    gap = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in common)
    print(f"{run}: {len(got)} steps, max relative loss gap to {sys.argv[1]}: {gap:.2e}; "
          f"last loss {got[max(got)]:.5f} vs {ref[max(ref)]:.5f}")
    for other in glob.glob(f"{run}/islands/*/metrics.jsonl"):  # the other islands' own parts
        rs += rows(other.removesuffix("/metrics.jsonl"))
    late = [r for r in rs if r["step"] >= 5]
    keys = sorted({k for r in late for k in r if "/" in k})
    print("  medians over steps >= 5: " + ", ".join(
        f"{k}={statistics.median(r[k] for r in late if k in r) * 1e3:.2f}ms" for k in keys))
EOF
}

echo "=== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import jax, flax, optax, orbax.checkpoint as o, grain; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'grain', grain.__version__, jax.devices())"

# 1. MFU of a Llama-3.2-1B-shaped model, with a profile of two steps; attention alone,
#    with cuDNN's packed layout at bounds that fit (256 documents asked 130 GiB of an H200).
check gpu_step 150 30 python -m bench.gpu_step --steps 6 --warmup 2 --profile "$work/profile"
check attention 90 8 python -m bench.attention --max-documents 32,64

# 2, 6. cuDNN against XLA attention over packed documents; the profiles' determinism.
check test_gpu 200 12 python -m pytest -q -s -p no:cacheprovider tests/test_gpu.py

# 3. CPU against CUDA from one initial checkpoint.
check platforms 120 25 python -m hetjax.repro platforms --config tiny --steps 20 --out "$work/platforms"

# 4. One job over two XLA backends (CUDA island, CPU island), over host and direct, against
#    the one-island run on 2 virtual CPU devices.
export JAX_DEFAULT_MATMUL_PRECISION=highest
for b in host direct; do
  check "islands_$b" 120 6 python -m launch.local --config configs/gpu_cpu_hetero.py --backend "$b" \
    --config.hetero.timeout_s=60 "--config.run_dir=$work/islands_$b"
done
check one_island 90 3 env JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=2 \
  python -m hetjax.train --config configs/gpu_cpu_hetero.py "--config.hetero.islands=()" \
  --config.mesh.pipeline=2 --config.sharding.max_replicated_fraction=1 --config.compile.platform=cpu \
  "--config.run_dir=$work/one_island"
unset JAX_DEFAULT_MATMUL_PRECISION
compare_losses "$work/one_island" "$work/islands_host" "$work/islands_direct" | tee "$work/islands.txt"

# 5. Transfers to and from GPU memory: CPU -> GPU (the local probe's server is on CPU),
#    then GPU -> CPU (a server on the GPU, the peer on CPU).
check probe_latency 90 8 python -m hetjax.transfer.probe --mib 1 --streams 1 --iters 50 --backends raw,host,direct
check bandwidth_cpu_to_gpu 120 10 python -m bench.transfer_bandwidth --iters 5 --dst-devices 1
timeout 150 python -m hetjax.transfer.probe --serve --bind 127.0.0.1 --port 5555 > "$work/gpu_server.log" 2>&1 &
server=$!
for _ in $(seq 60); do grep -q " on " "$work/gpu_server.log" && break; sleep 0.5; done
check bandwidth_gpu_to_cpu 120 10 env JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=1 \
  python -m bench.transfer_bandwidth --iters 5 --dst-devices 1 --peer 127.0.0.1:5555
kill "$server" 2>/dev/null && { echo "=== the GPU server was still running; its log:"; tail -n 5 "$work/gpu_server.log"; }

tar -czf "$out/logs.tgz" -C "$work" --exclude='*.pb' --exclude='*.json.gz' --exclude='checkpoints' .
ls -la "$out"
