"""Training data: grain pipelines over sources, tokenizers, packing, the synthetic language."""

__all__ = ["Data", "DataIterator", "build", "local_rows", "to_global"]


def __getattr__(name: str):
    # Lazy: prepare's worker processes import hetjax.data.* without jax and grain.
    if name in __all__:
        from hetjax.data import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module 'hetjax.data' has no attribute {name!r}")
