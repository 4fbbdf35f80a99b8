"""One decoder family for Llama 3 and Qwen2 (Flax NNX).

The two differ only in fields of `ModelConfig`: Qwen2 adds q/k/v biases and uses
RoPE theta 1e6 without frequency scaling; Llama 3(.1) uses theta 5e5 with its
low/high-frequency RoPE scaling. Everything else (RMSNorm, grouped-query
attention, SwiGLU, tied or untied embeddings) is shared.

Shape letters used in weight names and comments:
  B batch, T length, D embed, N heads, K kv_heads, H head_dim, F mlp, V vocab,
  L layers.

Parameters and activations carry *logical* axis names only; the config's rules
table decides which mesh axes they land on (see hetjax/sharding.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from hetjax.errors import ConfigError
from hetjax.sharding import constrain

# cuDNN's fused attention as it appears in a traced program (jax's private cuDNN module).
FUSED_ATTENTION = frozenset({"dot_product_attention_fwd", "dot_product_attention_fwd_wrapper"})


def dots_and_fused_attention(prim, *avals, **params) -> bool:
    """checkpoint_dots, and cuDNN's fused attention too (its output and softmax statistics,
    which XLA's attention keeps as the QK^T and PV dots): it is no dot_general, so under
    checkpoint_dots alone the backward pass ran its forward kernel again."""
    return prim.name in FUSED_ATTENTION or jax.checkpoint_policies.checkpoint_dots(prim, *avals, **params)


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": dots_and_fused_attention,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama 3 / Qwen2 decoder. Qwen2 = qkv_bias=True, rope_theta=1e6, no scaling."""

    vocab_size: int = 256
    num_layers: int = 2
    embed_dim: int = 64
    mlp_dim: int = 192
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    qkv_bias: bool = False
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_scaling_factor: float = 1.0  # > 1 turns on Llama 3's frequency scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_length: int = 8192
    dtype: str = "float32"  # compute dtype: float32 or bfloat16
    param_dtype: str = "float32"  # master weights stay fp32
    remat: str = "none"  # per-layer policy: none | full | dots | dots_no_batch
    attention_impl: str = "auto"  # jax.nn.dot_product_attention: auto (jax's pick: XLA on 0.10) | xla | cudnn

    def dims(self) -> dict[str, tuple[str, int]]:
        """Logical axis -> (config field, size), for divisibility checks."""
        return {
            "vocab": ("model.vocab_size", self.vocab_size),
            "embed": ("model.embed_dim", self.embed_dim),
            "mlp": ("model.mlp_dim", self.mlp_dim),
            "heads": ("model.num_heads", self.num_heads),
            "kv_heads": ("model.num_kv_heads", self.num_kv_heads),
            "head_dim": ("model.head_dim", self.head_dim),
            "layers": ("model.num_layers", self.num_layers),
        }


_CHOICES = {
    "dtype": ("float32", "bfloat16"),
    "param_dtype": ("float32", "bfloat16"),
    "remat": tuple(REMAT_POLICIES),
    "attention_impl": ATTENTION_IMPLEMENTATIONS,
}


def validate_model(m: ModelConfig) -> None:
    """Raises ConfigError for a choice or size the decoder cannot build."""
    for key, choices in _CHOICES.items():
        if getattr(m, key) not in choices:
            raise ConfigError(f"config.model.{key}={getattr(m, key)!r}: choose one of {choices}")
    for key in ("vocab_size", "num_layers", "embed_dim", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"config.model.{key}={getattr(m, key)}: must be positive")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"config.model.num_heads={m.num_heads} is not a multiple of "
            f"config.model.num_kv_heads={m.num_kv_heads}: grouped-query attention shares each "
            f"KV head among an equal number of query heads")
    if m.head_dim % 2:
        raise ConfigError(f"config.model.head_dim={m.head_dim}: RoPE needs an even head_dim")
    for key, example in (("norm_eps", "1e-5"), ("rope_theta", "500000.0")):
        if getattr(m, key) <= 0:
            raise ConfigError(f"config.model.{key}={getattr(m, key)}: must be positive, e.g. {example}")
    if m.rope_scaling_factor < 1:
        raise ConfigError(f"config.model.rope_scaling_factor={m.rope_scaling_factor}: use 1 (no scaling) or "
                          f"Llama 3's factor > 1, e.g. 8.0")
    if m.rope_scaling_factor > 1:  # the fields of Llama 3's scaling, used only then
        if m.rope_original_max_length <= 0:
            raise ConfigError(f"config.model.rope_original_max_length={m.rope_original_max_length}: must be "
                              f"positive, e.g. 8192")
        if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
            raise ConfigError(
                f"config.model.rope_low_freq_factor={m.rope_low_freq_factor} and rope_high_freq_factor="
                f"{m.rope_high_freq_factor}: need 0 < low < high (Llama 3.1: 1.0 and 4.0)")

_init = nnx.initializers.normal(stddev=0.02)


def _param(rngs: nnx.Rngs, shape, axes, dtype, init=_init) -> nnx.Param:
    # eager_sharding=False: placement is decided once, by hetjax.sharding, when
    # the whole state is created under jit with out_shardings.
    assert len(shape) == len(axes), (shape, axes)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


def _ones(key, shape, dtype):
    del key
    return jnp.ones(shape, dtype)


def _zeros(key, shape, dtype):
    del key
    return jnp.zeros(shape, dtype)


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling_factor: float = 1.0,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_length: int = 8192,
) -> jax.Array:
    """RoPE inverse frequencies, with Llama 3's frequency scaling when factor > 1."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling_factor == 1.0:
        return inv_freq
    # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, and
    # the band in between interpolated smoothly.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = original_max_length / low_freq_factor
    high_freq_wavelen = original_max_length / high_freq_factor
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / scaling_factor, inv_freq)
    smooth = (original_max_length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling_factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)


def packed_segments(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """Segment ids of packed rows (each document a contiguous run) -> cuDNN's packed
    layout: (lengths (B, M), starts (B, M + 1)), both padded with -1 past a row's last
    document. A row of more than `max_segments` documents is the caller's to rule out:
    its extra documents would be merged into the last one."""
    B, T = segment_ids.shape
    is_start = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    starts = jax.vmap(lambda r: jnp.nonzero(r, size=max_segments, fill_value=-1)[0])(is_start)
    starts = jnp.pad(starts.astype(jnp.int32), ((0, 0), (0, 1)), constant_values=-1)  # (B, M + 1)
    following = jnp.where(starts[:, 1:] >= 0, starts[:, 1:], T)
    lengths = jnp.where(starts[:, :-1] >= 0, following - starts[:, :-1], -1)  # (B, M)
    return lengths, starts


def cudnn_packed_attention(q, k, v, segment_ids, max_documents: int):
    """Causal attention within each document of packed rows, by cuDNN's packed layout:
    (B, T, N, H) queries, (B, T, K, H) keys and values -> (B, T, N, H).

    jax.nn.dot_product_attention(implementation="cudnn") turns a (B, 1, T, T) mask into an
    additive bias that both passes read; given each row's document starts and lengths
    instead, cuDNN skips the other documents' blocks (bench.attention, Llama-3.2-1B's shape
    on an H200: up to 3.3x faster, less as `max_documents` grows past the rows' real count).
    cuDNN's workspace grows with `max_documents` (room for T documents asked 2 TiB), and a
    row with more documents than that would be attended wrongly, so the model does not use
    it until the data bounds documents per row. jax exposes the packed layout only in its
    private cuDNN module."""
    if max_documents < 2:  # jax takes offsets of one segment per row as an unpacked layout
        raise ValueError(f"max_documents={max_documents}: cuDNN's packed layout needs room for at least 2")
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    lengths, starts = packed_segments(segment_ids, max_documents)
    return dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts,
                                 kv_offsets=starts, scale=q.shape[-1] ** -0.5, mask_type=MaskType.PADDING_CAUSAL)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates (B, T, N, H) by positions (B, T); halves convention, as in HF Llama."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # (B, T, H/2)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale_D = _param(rngs, (dim,), ("embed",), param_dtype, init=_ones)

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in fp32 whatever the compute dtype: bf16 variance is too coarse.
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale_D[...].astype(jnp.float32)).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with RoPE and segment masking."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool,
        implementation: str,
        dtype,
        param_dtype,
        rngs: nnx.Rngs,
    ):
        D, N, K, H = embed_dim, num_heads, num_kv_heads, head_dim
        self.q_DNH = _param(rngs, (D, N, H), ("embed", "heads", "head_dim"), param_dtype)
        self.k_DKH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.v_DKH = _param(rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.o_NHD = _param(rngs, (N, H, D), ("heads", "head_dim", "embed"), param_dtype)
        if qkv_bias:
            self.q_bias_NH = _param(rngs, (N, H), ("heads", "head_dim"), param_dtype, init=_zeros)
            self.k_bias_KH = _param(rngs, (K, H), ("kv_heads", "head_dim"), param_dtype, init=_zeros)
            self.v_bias_KH = _param(rngs, (K, H), ("kv_heads", "head_dim"), param_dtype, init=_zeros)
        self.qkv_bias = qkv_bias
        self.implementation = None if implementation == "auto" else implementation
        self.dtype = dtype

    def __call__(self, x, positions, segment_ids, inv_freq):
        dt = self.dtype
        q = jnp.einsum("BTD,DNH->BTNH", x, self.q_DNH[...].astype(dt))
        k = jnp.einsum("BTD,DKH->BTKH", x, self.k_DKH[...].astype(dt))
        v = jnp.einsum("BTD,DKH->BTKH", x, self.v_DKH[...].astype(dt))
        if self.qkv_bias:
            q = q + self.q_bias_NH[...].astype(dt)
            k = k + self.k_bias_KH[...].astype(dt)
            v = v + self.v_bias_KH[...].astype(dt)
        q = constrain(apply_rope(q, positions, inv_freq), ("batch", "length", "heads", "head_dim"))
        k = constrain(apply_rope(k, positions, inv_freq), ("batch", "length", "kv_heads", "head_dim"))
        v = constrain(v, ("batch", "length", "kv_heads", "head_dim"))
        # Packed documents: a token sees only earlier tokens of its own segment.
        # cuDNN turns this mask into an additive bias; its packed layout (cudnn_packed_attention)
        # is up to 3.3x faster but needs a bound on documents per row that the data lacks.
        same_segment = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]  # (B, 1, T, T)
        out = jax.nn.dot_product_attention(
            q, k, v, mask=same_segment, is_causal=True, implementation=self.implementation
        )  # (B, T, N, H)
        out = constrain(out, ("batch", "length", "heads", "head_dim"))
        return jnp.einsum("BTNH,NHD->BTD", out, self.o_NHD[...].astype(dt))


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, embed_dim: int, mlp_dim: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        D, F = embed_dim, mlp_dim
        self.gate_DF = _param(rngs, (D, F), ("embed", "mlp"), param_dtype)
        self.up_DF = _param(rngs, (D, F), ("embed", "mlp"), param_dtype)
        self.down_FD = _param(rngs, (F, D), ("mlp", "embed"), param_dtype)
        self.dtype = dtype

    def __call__(self, x):
        dt = self.dtype
        gate = jnp.einsum("BTD,DF->BTF", x, self.gate_DF[...].astype(dt))
        up = jnp.einsum("BTD,DF->BTF", x, self.up_DF[...].astype(dt))
        hidden = constrain(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
        return jnp.einsum("BTF,FD->BTD", hidden, self.down_FD[...].astype(dt))


class Block(nnx.Module):
    """Pre-norm decoder layer."""

    def __init__(self, embed_dim, mlp_dim, num_heads, num_kv_heads, head_dim, *, norm_eps,
                 qkv_bias, attention_impl, dtype, param_dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(embed_dim, eps=norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.attn = Attention(embed_dim, num_heads, num_kv_heads, head_dim, qkv_bias=qkv_bias,
                              implementation=attention_impl, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
        self.mlp_norm = RMSNorm(embed_dim, eps=norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.mlp = MLP(embed_dim, mlp_dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, segment_ids, inv_freq):
        x = x + self.attn(self.attn_norm(x), positions, segment_ids, inv_freq)
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, ("batch", "length", "embed"))


# The Decoder's top-level parameter names, for code that splits the model by name
# (pipeline stages, islands): the stacked layers, the embedding, and the head.
BLOCKS = "blocks"
EMBED = "embed_VD"
HEAD = ("final_norm", "unembed_DV")


class Decoder(nnx.Module):
    """Token ids (B, T) -> logits (B, T, V) in fp32.

    The L blocks are created stacked (every weight gets a leading `layers` axis)
    and applied with `jax.lax.scan`, so compile time does not grow with depth.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed_VD = _param(rngs, (cfg.vocab_size, cfg.embed_dim), ("vocab", "embed"), param_dtype)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs):
            return Block(cfg.embed_dim, cfg.mlp_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                         norm_eps=cfg.norm_eps, qkv_bias=cfg.qkv_bias,
                         attention_impl=cfg.attention_impl, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = RMSNorm(cfg.embed_dim, eps=cfg.norm_eps, param_dtype=param_dtype, rngs=rngs)
        if not cfg.tie_embeddings:
            self.unembed_DV = _param(rngs, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), param_dtype)
        self.tie_embeddings = cfg.tie_embeddings
        self.remat = cfg.remat
        self.dtype = dtype
        # A tuple, not a dict: static module attributes must be hashable so the
        # graphdef can be a static jit argument.
        self.rope = (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor,
                     cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                     cfg.rope_original_max_length)

    def __call__(self, tokens, positions=None, segment_ids=None):
        B, T = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        x = self.embed(tokens)
        x = self.apply_layers(x, positions, segment_ids)
        return self.logits(x)

    # The three parts below are also a pipeline's stages: the first stage embeds,
    # every stage applies its slice of the stacked layers, the last one projects.

    def embed(self, tokens):
        x = jnp.take(self.embed_VD[...], tokens, axis=0).astype(self.dtype)  # (B, T, D)
        return constrain(x, ("batch", "length", "embed"))

    def apply_layers(self, x, positions, segment_ids, valid=None, unroll: bool = False):
        """Scans the layers stacked in self.blocks (any number of them: a pipeline stage
        holds its own) over x. `valid` (bool per layer) turns a layer into the identity:
        pipeline padding. unroll: the same layers written out one after the other (the
        pipeline's few layers per stage run faster so, see config.pipeline.scan_layers)."""
        inv_freq = rope_inv_freq(*self.rope)
        blocks_def, blocks_state = nnx.split(self.blocks)

        def layer(x, state_and_valid):
            state, ok = state_and_valid
            y = nnx.merge(blocks_def, state)(x, positions, segment_ids, inv_freq)
            return (y if ok is None else jnp.where(ok, y, x)), None

        if self.remat != "none":
            # Unrolled, XLA could merge a recomputation with the forward it repeats.
            layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat], prevent_cse=unroll)
        x, _ = jax.lax.scan(layer, x, (blocks_state, valid), unroll=True if unroll else 1)
        return x

    def logits(self, x):
        x = self.final_norm(x)
        unembed = self.embed_VD[...].T if self.tie_embeddings else self.unembed_DV[...]
        logits = jnp.einsum("BTD,DV->BTV", x, unembed.astype(self.dtype))
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"))
