"""The tiny model on real text: a corpus prepared by hetjax.data.prepare and its tokenizer.

    python -m hetjax.data.prepare --input 'corpus/*.jsonl.gz' --tokenizer tok/tokenizer.json \\
        --output data/tiny_text
    python -m hetjax.train --config tiny_text --config.data.path=data/tiny_text \\
        --config.data.tokenizer=tok/tokenizer.json

vocab_size fits a tokenizer of up to 512 ids (training refuses a larger one, naming
both sizes). tests/test_data_corpora.py trains it on a corpus and a BPE tokenizer
made in the test.
"""

from hetjax.config import Config, DataConfig, MeshConfig, ModelConfig, OptimConfig


def get_config() -> Config:
    return Config(
        name="tiny_text",
        model=ModelConfig(vocab_size=512, num_layers=2, embed_dim=64, mlp_dim=192, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=10_000.0),
        mesh=MeshConfig(fsdp=-1),
        optim=OptimConfig(learning_rate=3e-3, warmup_steps=10, weight_decay=0.01),
        data=DataConfig(source="array_record", path="data/tiny_text", tokenizer="tok/tokenizer.json"),
        steps=200,
        batch_size=16,
        seq_len=64,
        log_every=10,
        eval_every=100,
        run_dir="runs/tiny_text",
    )
