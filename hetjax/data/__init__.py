"""Training data: grain pipelines over sources, tokenizers, packing, the synthetic language."""

from hetjax.data.pipeline import Data, DataIterator, build, local_rows, to_global

__all__ = ["Data", "DataIterator", "build", "local_rows", "to_global"]
