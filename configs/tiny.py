"""A tiny Llama-3-style model that trains on 2 CPU cores in about a minute."""

from hetjax.config import Config, DataConfig, MeshConfig, ModelConfig, OptimConfig


def get_config() -> Config:
    return Config(
        name="tiny",
        model=ModelConfig(vocab_size=256, num_layers=2, embed_dim=64, mlp_dim=192, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=10_000.0),
        mesh=MeshConfig(fsdp=-1),
        optim=OptimConfig(learning_rate=3e-3, warmup_steps=20, weight_decay=0.01),
        data=DataConfig(num_states=32, branching=8, mean_doc_length=48),
        steps=300,
        batch_size=16,
        seq_len=64,
        log_every=25,
        eval_every=100,
        run_dir="runs/tiny",
    )
