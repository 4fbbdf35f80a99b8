#!/usr/bin/env bash
# Installs hetjax into a vendor's JAX image the way the README does (a venv, then
# `.venv/bin/pip install -q -e .`), keeping the image's own jax: the venv sees the system
# packages, and a constraints file pins every jax distribution the image has (jax, jaxlib,
# the CUDA or ROCm plugin) to its installed version, so that pip either keeps them or
# stops with a conflict instead of replacing the vendor's build with PyPI's.
#
#   launch/docker/install.sh [REPO]      # run by launch/docker/*.Dockerfile, in the image
set -euo pipefail
cd "${1:-.}"

keep=/tmp/hetjax-keep-jax.txt
python3 - > "$keep" <<'PY'
import importlib.metadata as md
pins = sorted({f"{d.metadata['Name']}=={d.version}" for d in md.distributions()
               if (d.metadata["Name"] or "").lower().startswith("jax")})
if not any(p.lower().startswith(("jax==", "jaxlib==")) for p in pins):
    raise SystemExit("launch/docker/install.sh: the base image's python3 has no jax; "
                     "build FROM a vendor JAX image (ARG BASE)")
print("\n".join(pins))
PY
echo "keeping the base image's jax: $(tr '\n' ' ' < "$keep")"

if ! python3 -m venv --system-site-packages .venv; then
  # Debian/Ubuntu keep venv's pip bootstrap in a separate package.
  rm -rf .venv
  apt-get update && apt-get install -y --no-install-recommends python3-venv && rm -rf /var/lib/apt/lists/*
  python3 -m venv --system-site-packages .venv
fi
PIP_CONSTRAINT="$keep" .venv/bin/pip install -q -e .

before="$(python3 -c 'import jax; print(jax.__version__, jax.__file__)')"
after="$(.venv/bin/python -c 'import jax, hetjax; print(jax.__version__, jax.__file__)')"
if [[ "$before" != "$after" ]]; then
  echo "launch/docker/install.sh: error: the venv's jax ($after) is not the base image's ($before)" >&2
  exit 1
fi
echo "hetjax installed in $PWD/.venv over jax $after"
