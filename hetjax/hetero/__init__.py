"""Islands: homogeneous sub-meshes, each its own jax.distributed world, joined by the
transfer primitive (hetjax.transfer). Pipeline stages or data-parallel shares of one
training job live on different islands (config.hetero)."""
