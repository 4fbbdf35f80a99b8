"""Llama-3(.1)-8B's published shape, with Llama 3's RoPE frequency scaling.

Real data: tokenize the corpus once with the model's own tokenizer (a local copy of
meta-llama/Llama-3.1-8B: its directory, tokenizer.json or the original tiktoken tokenizer.model),
on every core, then train from the shards (memory-mapped; start-up does not grow with them):

    python -m hetjax.data.prepare --input 'fineweb/*.parquet' --tokenizer ckpt/llama8b \\
        --output data/llama8b-fineweb
    python -m hetjax.train --config llama8b --config.data.source=array_record \\
        --config.data.path=data/llama8b-fineweb --config.data.tokenizer=ckpt/llama8b

Each document gets <|begin_of_text|> ... <|end_of_text|> (config.data.bos/eos=auto
follows the tokenizer). Several corpora: --config.data.mixture="(('web', 0.8, 'array_record',
'data/web'), ('code', 0.2, 'array_record', 'data/code'))".
"""

from hetjax.config import Config, MeshConfig, ModelConfig, OptimConfig


def get_config() -> Config:
    return Config(
        name="llama8b",
        model=ModelConfig(
            vocab_size=128256, num_layers=32, embed_dim=4096, mlp_dim=14336, num_heads=32,
            num_kv_heads=8, head_dim=128, qkv_bias=False, tie_embeddings=False, norm_eps=1e-5,
            rope_theta=500_000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
            rope_high_freq_factor=4.0, rope_original_max_length=8192,
            dtype="bfloat16", param_dtype="float32", remat="full"),
        mesh=MeshConfig(fsdp=-1),
        optim=OptimConfig(learning_rate=3e-4, warmup_steps=2000, weight_decay=0.1),
        steps=100_000,
        batch_size=256,
        seq_len=8192,
        log_every=10,
        eval_every=1000,
        run_dir="runs/llama8b",
    )
