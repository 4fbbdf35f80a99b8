"""Qwen2-7B's published shape: q/k/v biases, RoPE theta 1e6, no RoPE scaling.

Real data: tokenize the corpus once with the model's own tokenizer (a local copy of
Qwen/Qwen2-7B: its directory, tokenizer.json),
on every core, then train from the shards (memory-mapped; start-up does not grow with them):

    python -m hetjax.data.prepare --input 'fineweb/*.parquet' --tokenizer ckpt/qwen2_7b \\
        --output data/qwen2_7b-fineweb
    python -m hetjax.train --config qwen2_7b --config.data.source=array_record \\
        --config.data.path=data/qwen2_7b-fineweb --config.data.tokenizer=ckpt/qwen2_7b

Each document ends with <|endoftext|> (Qwen2 has no BOS) (config.data.bos/eos=auto
follows the tokenizer). Several corpora: --config.data.mixture="(('web', 0.8, 'array_record',
'data/web'), ('code', 0.2, 'array_record', 'data/code'))".
"""

from hetjax.config import Config, MeshConfig, ModelConfig, OptimConfig


def get_config() -> Config:
    return Config(
        name="qwen2_7b",
        model=ModelConfig(
            vocab_size=152064, num_layers=28, embed_dim=3584, mlp_dim=18944, num_heads=28,
            num_kv_heads=4, head_dim=128, qkv_bias=True, tie_embeddings=False, norm_eps=1e-6,
            rope_theta=1_000_000.0, rope_scaling_factor=1.0,
            dtype="bfloat16", param_dtype="float32", remat="full"),
        mesh=MeshConfig(fsdp=-1),
        optim=OptimConfig(learning_rate=3e-4, warmup_steps=2000, weight_decay=0.1),
        steps=100_000,
        batch_size=256,
        seq_len=8192,
        log_every=10,
        eval_every=1000,
        run_dir="runs/qwen2_7b",
    )
