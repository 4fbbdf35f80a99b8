"""An independent, deliberately plain reference for the Llama 3 / Qwen2 decoder.

Written from the published equations (HF transformers' LlamaModel / Qwen2Model),
not from models/llama.py, so the two can check each other:

  * RMSNorm: fp32 statistics, y = x * rsqrt(mean(x^2) + eps) * scale.
  * Attention: q/k/v projections (+ bias for Qwen2, before RoPE), RoPE in the
    `rotate_half` convention, K/V heads repeated to N heads (HF `repeat_kv`:
    query head n reads KV head n // (N/K)), explicit scores / sqrt(H), an
    explicit boolean mask (causal by index AND same segment), explicit softmax.
  * SwiGLU MLP: down(silu(x @ gate) * (x @ up)).
  * Pre-norm residual blocks, looped in Python (no scan), final norm, logits in
    fp32 against `unembed` or, when tied, the embedding matrix transposed.
  * Llama 3.1 RoPE frequency scaling computed in float64 with a Python loop.

No jax.nn.dot_product_attention, no einsum-shaped weights: weights are reshaped
to the (in_features, out_features) matrices that HF's nn.Linear layers hold
(transposed), and applied with plain matmuls.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


# ---------------------------------------------------------------------------
# RoPE frequencies


def unscaled_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """inv_freq[i] = 1 / theta^(2i / head_dim), i = 0 .. head_dim/2 - 1, in float64."""
    return np.array([1.0 / (theta ** (2.0 * i / head_dim)) for i in range(head_dim // 2)],
                    dtype=np.float64)


def llama3_band(inv_freq: float, factor_low: float, factor_high: float, original_max: int) -> str:
    """Which band of Llama 3.1's scaling rule a frequency falls in: high | medium | low."""
    wavelen = 2.0 * math.pi / inv_freq
    if wavelen < original_max / factor_high:
        return "high"
    if wavelen > original_max / factor_low:
        return "low"
    return "medium"


def reference_inv_freq(head_dim: int, theta: float, scaling_factor: float = 1.0,
                       low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                       original_max_length: int = 8192) -> np.ndarray:
    """HF `_compute_llama3_parameters`, one frequency at a time, in float64.

    scaling_factor == 1 is HF's "default" rope type (no scaling; Qwen2).
    """
    base = unscaled_inv_freq(head_dim, theta)
    if scaling_factor == 1.0:
        return base
    out = []
    for inv in base:
        band = llama3_band(inv, low_freq_factor, high_freq_factor, original_max_length)
        if band == "high":  # short wavelengths: unchanged
            new = inv
        elif band == "low":  # long wavelengths: stretched by the factor
            new = inv / scaling_factor
        else:  # interpolate between the two
            wavelen = 2.0 * math.pi / inv
            smooth = (original_max_length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new = (1.0 - smooth) * inv / scaling_factor + smooth * inv
        out.append(new)
    return np.array(out, dtype=np.float64)


def rotate_half(x):
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return jnp.concatenate([-x2, x1], axis=-1)


def rope_cos_sin(positions, inv_freq: np.ndarray):
    """cos, sin of shape (B, T, H): angle = position * inv_freq, duplicated to both halves."""
    inv = jnp.asarray(inv_freq, dtype=jnp.float32)
    freqs = positions.astype(jnp.float32)[:, :, None] * inv[None, None, :]  # (B, T, H/2)
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # (B, T, H)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x, cos, sin):
    """x: (B, N, T, H); cos/sin: (B, T, H)."""
    cos = cos[:, None, :, :]
    sin = sin[:, None, :, :]
    return x * cos + rotate_half(x) * sin


# ---------------------------------------------------------------------------
# Layers


def rms_norm(x, scale, eps):
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(variance + eps)
    return normed * scale.astype(jnp.float32)


def silu(x):
    return x / (1.0 + jnp.exp(-x))


def softmax(scores):
    m = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.exp(scores - m)
    return e / jnp.sum(e, axis=-1, keepdims=True)


def attention_mask(segment_ids):
    """(B, 1, T, T) boolean: query i may read key j iff j <= i and both share a segment."""
    T = segment_ids.shape[1]
    idx = np.arange(T)
    causal = jnp.asarray(idx[:, None] >= idx[None, :])  # (T, T)
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, T)
    return (causal[None, :, :] & same)[:, None, :, :]


def attention(p, x, cos, sin, mask, cfg):
    B, T, D = x.shape
    N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    # HF: q_proj = nn.Linear(D, N*H); here the (in, out) matrix, flattened head-major.
    wq = p["q_DNH"].reshape(D, N * H)
    wk = p["k_DKH"].reshape(D, K * H)
    wv = p["v_DKH"].reshape(D, K * H)
    wo = p["o_NHD"].reshape(N * H, D)
    q = x @ wq
    k = x @ wk
    v = x @ wv
    if cfg.qkv_bias:
        q = q + p["q_bias_NH"].reshape(N * H)
        k = k + p["k_bias_KH"].reshape(K * H)
        v = v + p["v_bias_KH"].reshape(K * H)
    # (B, T, heads*H) -> (B, heads, T, H)
    q = q.reshape(B, T, N, H).transpose(0, 2, 1, 3)
    k = k.reshape(B, T, K, H).transpose(0, 2, 1, 3)
    v = v.reshape(B, T, K, H).transpose(0, 2, 1, 3)
    q = apply_rotary(q, cos, sin)
    k = apply_rotary(k, cos, sin)
    # HF repeat_kv: (B, K, T, H) -> (B, K, rep, T, H) -> (B, K*rep, T, H).
    rep = N // K
    k = jnp.broadcast_to(k[:, :, None], (B, K, rep, T, H)).reshape(B, N, T, H)
    v = jnp.broadcast_to(v[:, :, None], (B, K, rep, T, H)).reshape(B, N, T, H)
    scores = (q @ k.transpose(0, 1, 3, 2)) / math.sqrt(H)  # (B, N, T, T)
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = softmax(scores.astype(jnp.float32)).astype(v.dtype)
    out = probs @ v  # (B, N, T, H)
    out = out.transpose(0, 2, 1, 3).reshape(B, T, N * H)
    return out @ wo


def mlp(p, x):
    return (silu(x @ p["gate_DF"]) * (x @ p["up_DF"])) @ p["down_FD"]


def layer_params(blocks, i):
    return jax.tree.map(lambda a: a[i], blocks)


def forward(params, tokens, positions, segment_ids, cfg):
    """(B, T) int tokens -> (B, T, V) fp32 logits. `params` is nnx.to_pure_dict's layout."""
    inv_freq = reference_inv_freq(
        cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
        cfg.rope_high_freq_factor, cfg.rope_original_max_length)
    cos, sin = rope_cos_sin(positions, inv_freq)
    mask = attention_mask(segment_ids)
    embed = params["embed_VD"]
    x = embed[tokens].astype(jnp.float32)
    for i in range(cfg.num_layers):
        p = layer_params(params["blocks"], i)
        h = rms_norm(x, p["attn_norm"]["scale_D"], cfg.norm_eps)
        x = x + attention(p["attn"], h, cos, sin, mask, cfg)
        h = rms_norm(x, p["mlp_norm"]["scale_D"], cfg.norm_eps)
        x = x + mlp(p["mlp"], h)
    x = rms_norm(x, params["final_norm"]["scale_D"], cfg.norm_eps)
    unembed = embed.T if cfg.tie_embeddings else params["unembed_DV"]
    return (x @ unembed).astype(jnp.float32)
