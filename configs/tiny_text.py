"""The tiny model (configs/tiny.py) on real text: a corpus prepared by hetjax.data.prepare and its tokenizer.

    python -m hetjax.data.prepare --input 'corpus/*.jsonl.gz' --tokenizer tok/tokenizer.json \\
        --output data/tiny_text
    python -m hetjax.train --config tiny_text --config.data.path=data/tiny_text \\
        --config.data.tokenizer=tok/tokenizer.json

vocab_size fits a tokenizer of up to 512 ids (training refuses a larger one, naming
both sizes). tests/test_data_corpora.py trains it on a corpus and a BPE tokenizer
made in the test.
"""

import dataclasses

from hetjax.config import Config, DataConfig
from hetjax.configs import tiny


def get_config() -> Config:
    cfg = tiny.get_config()
    return dataclasses.replace(
        cfg, name="tiny_text", model=dataclasses.replace(cfg.model, vocab_size=512),
        optim=dataclasses.replace(cfg.optim, warmup_steps=10),
        data=DataConfig(source="array_record", path="data/tiny_text", tokenizer="tok/tokenizer.json"),
        steps=200, log_every=10, run_dir="runs/tiny_text")
