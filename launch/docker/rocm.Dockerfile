# hetjax for AMD GPUs: AMD's JAX image (ROCm, RCCL, jax with its ROCm plugin) with hetjax
# installed over it, keeping that jax (launch/docker/install.sh).
#
#   docker build -f launch/docker/rocm.Dockerfile -t REGISTRY/hetjax:rocm .
#
# Pin a versioned rocm/jax tag for an image you can rebuild: --build-arg BASE=...
# hetjax needs jax >= 0.10: with an older base the install stops with pip's conflict.
ARG BASE=rocm/jax:latest
FROM ${BASE}
WORKDIR /opt/hetjax
COPY . .
RUN bash launch/docker/install.sh
ENV PATH=/opt/hetjax/.venv/bin:${PATH} PYTHONUNBUFFERED=1
ENTRYPOINT ["python", "-m", "hetjax.train"]
CMD ["--config", "configs/llama8b_hetero.py"]
