"""Run fingerprints, and comparisons of runs across vendors and layouts.

digest.py       all hashing: checkpoint checksums, and the fingerprints of batches and parameters
record.py       Recorder: what every training run writes (run_dir/fingerprints.jsonl)
compare.py      two runs side by side: first divergences, gaps, a verdict, a plot
check.py        one config under several layouts, each compared with the first
__main__.py     `python -m hetjax.repro compare A B` and `python -m hetjax.repro check ...`
"""

from hetjax.repro.digest import (ParamFingerprint, TensorPrint, batch_digest, batch_words,
                                      combine_rows, param_fingerprint, param_stats)
from hetjax.repro.record import FILE, Recorder, read

__all__ = ["ParamFingerprint", "TensorPrint", "batch_digest", "batch_words", "combine_rows",
           "param_fingerprint", "param_stats", "FILE", "Recorder", "read"]
