#!/usr/bin/env bash
# Installs hetjax into a vendor's JAX image the way the README does (a venv, then
# `.venv/bin/pip install -q -e .`), keeping the image's own jax: the venv sees the system
# packages, and a constraints file pins every jax distribution the image has (jax, jaxlib,
# the CUDA or ROCm plugin) to its installed version, so that pip either keeps them or
# stops with a conflict instead of replacing the vendor's build with PyPI's.
#
#   launch/docker/install.sh [REPO [VENV]]   # REPO/.venv; run so by launch/docker/*.Dockerfile
#
# On a cluster without containers, run it once on a node of each vendor, with that
# vendor's jax in python3 and a venv per vendor on shared storage, e.g.
#   srun -p h100 -N1 launch/docker/install.sh "$PWD" "$PWD/.venv-cuda"
set -euo pipefail
cd "${1:-.}"
venv="${2:-.venv}"

keep="$(mktemp)"
python3 - > "$keep" <<'PY'
import importlib.metadata as md
pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in md.distributions()
               if (d.metadata["Name"] or "").lower().startswith("jax")})
if not any(p.lower().startswith(("jax==", "jaxlib==")) for p in pins):
    raise SystemExit("launch/docker/install.sh: python3 has no jax; build FROM a vendor JAX "
                     "image (ARG BASE), or run this where python3 has the vendor's jax")
print("\n".join(pins))
PY
echo "keeping python3's jax: $(tr '\n' ' ' < "$keep")"

if ! python3 -m venv --system-site-packages "$venv"; then
  # Debian/Ubuntu keep venv's pip bootstrap in a separate package (installable in an image).
  (( EUID == 0 )) || { echo "launch/docker/install.sh: error: python3 -m venv failed; install python3-venv" >&2; exit 1; }
  rm -rf "$venv"
  apt-get update && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/*
  python3 -m venv --system-site-packages "$venv"
fi
PIP_CONSTRAINT="$keep" "$venv/bin/pip" install -q -e .

before="$(python3 -c 'import jax; print(jax.__version__, jax.__file__)')"
after="$("$venv/bin/python" -c 'import jax, hetjax; print(jax.__version__, jax.__file__)')"
if [[ "$before" != "$after" ]]; then
  echo "launch/docker/install.sh: error: the venv's jax ($after) is not the base image's ($before)" >&2
  exit 1
fi
echo "hetjax installed in $venv over jax $after"
