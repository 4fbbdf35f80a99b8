"""hetjax: train one LLM across islands of mixed GPU vendors."""

__version__ = "0.1.0"
