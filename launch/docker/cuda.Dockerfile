# hetjax for NVIDIA GPUs: NVIDIA's JAX image (CUDA, cuDNN, NCCL and a jax built for them)
# with hetjax installed over it, keeping that jax (launch/docker/install.sh).
#
#   docker build -f launch/docker/cuda.Dockerfile -t REGISTRY/hetjax:cuda .
#
# ghcr.io/nvidia/jax:jax is JAX-Toolbox's nightly; pin a dated tag (jax-YYYY-MM-DD) or NGC's
# nvcr.io/nvidia/jax:YY.MM-py3 for an image you can rebuild: --build-arg BASE=...
# hetjax needs jax >= 0.10: with an older base the install stops with pip's conflict.
ARG BASE=ghcr.io/nvidia/jax:jax
FROM ${BASE}
WORKDIR /opt/hetjax
COPY . .
RUN bash launch/docker/install.sh
ENV PATH=/opt/hetjax/.venv/bin:${PATH} PYTHONUNBUFFERED=1
ENTRYPOINT ["python", "-m", "hetjax.train"]
CMD ["--config", "configs/llama8b_hetero.py"]
