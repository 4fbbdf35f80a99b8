"""Training data. Until the grain pipelines land, a seeded synthetic stream."""

from hetjax.data.synthetic import SyntheticStream, global_batch

__all__ = ["SyntheticStream", "global_batch"]
