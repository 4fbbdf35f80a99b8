"""models.llama.Decoder against the independent plain-jnp reference in tests/reference.py.

All on CPU in fp32 with tiny shapes. Every parameter (biases and norm scales
included, which initialise to 0 / 1) is replaced by random values before
comparing, so each of them is exercised.

Tolerances: logits |model - ref| <= 1e-5 + 1e-5 * |ref| (logits are O(1));
gradients max|model - ref| <= 1e-5 * max|ref| per tensor; remat policies within
1e-6 of "none".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hetjax.config import ModelConfig
from hetjax.models.llama import Decoder, rope_inv_freq
from tests import reference as ref

SMALL = dict(vocab_size=64, num_layers=2, embed_dim=32, mlp_dim=48, num_heads=4,
             num_kv_heads=2, head_dim=8, dtype="float32")

# Llama 3(.1): untied, no bias, theta 5e5 with frequency scaling. With head_dim 8
# the wavelengths are ~6.3, ~167, ~4.4e3, ~1.2e5; original_max_length 256 puts
# them in the high (< 64), medium (64..256) and low (> 256) bands.
LLAMA3 = ModelConfig(**SMALL, qkv_bias=False, tie_embeddings=False, norm_eps=1e-5,
                     rope_theta=500_000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0, rope_original_max_length=256)
# Qwen2: q/k/v biases, tied embeddings, theta 1e6, no scaling, eps 1e-6.
QWEN2 = ModelConfig(**SMALL, qkv_bias=True, tie_embeddings=True, norm_eps=1e-6,
                    rope_theta=1_000_000.0)
CONFIGS = {"llama3": LLAMA3, "qwen2": QWEN2}

B, T = 2, 16


@pytest.fixture(autouse=True)
def _highest_precision():
    """fp32 matmuls at full precision inside this module only."""
    with jax.default_matmul_precision("highest"):
        yield


# ---------------------------------------------------------------------------
# Helpers


def expected_shapes(cfg: ModelConfig) -> dict:
    L, D, N, K, H, F, V = (cfg.num_layers, cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads,
                           cfg.head_dim, cfg.mlp_dim, cfg.vocab_size)
    attn = {"q_DNH": (L, D, N, H), "k_DKH": (L, D, K, H), "v_DKH": (L, D, K, H),
            "o_NHD": (L, N, H, D)}
    if cfg.qkv_bias:
        attn.update(q_bias_NH=(L, N, H), k_bias_KH=(L, K, H), v_bias_KH=(L, K, H))
    shapes = {
        "embed_VD": (V, D),
        "final_norm": {"scale_D": (D,)},
        "blocks": {
            "attn_norm": {"scale_D": (L, D)},
            "mlp_norm": {"scale_D": (L, D)},
            "attn": attn,
            "mlp": {"gate_DF": (L, D, F), "up_DF": (L, D, F), "down_FD": (L, F, D)},
        },
    }
    if not cfg.tie_embeddings:
        shapes["unembed_DV"] = (D, V)
    return shapes


def random_params(pure: dict, seed: int) -> dict:
    """Random values for every leaf: norm scales ~ 1 + 0.2 N(0,1), the embedding
    ~ 0.25 N(0,1), biases ~ 0.2 N(0,1), matrices ~ N(0,1)/sqrt(fan_in) (q/k twice
    that, so attention is far from uniform). numpy's generator: no compiling."""
    rng = np.random.default_rng(seed)
    paths, treedef = jax.tree_util.tree_flatten_with_path(pure)
    leaves = []
    for path, leaf in paths:
        name = jax.tree_util.keystr(path)
        z = rng.standard_normal(leaf.shape)
        if "scale_D" in name:
            value = 1.0 + 0.2 * z
        elif "bias" in name:
            value = 0.2 * z
        elif "embed_VD" in name:  # 0.25 ~ 1/sqrt(D): tied logits stay O(1)
            value = 0.25 * z
        elif "unembed_DV" in name or "down_FD" in name:
            value = z / np.sqrt(leaf.shape[-2])
        elif "o_NHD" in name:
            value = z / np.sqrt(leaf.shape[-3] * leaf.shape[-2])
        elif "q_DNH" in name or "k_DKH" in name:
            value = 2.0 * z / np.sqrt(leaf.shape[1])
        else:  # v, gate, up: (L, D, ...)
            value = z / np.sqrt(leaf.shape[1])
        leaves.append(jnp.asarray(value, leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)


@functools.lru_cache(maxsize=None)
def build(cfg: ModelConfig, seed: int = 0):
    """(graphdef, state, pure params) of a Decoder whose every parameter is random.

    The model is only traced (nnx.eval_shape), never initialised eagerly: every
    parameter is replaced anyway, and eager init costs seconds on CPU.
    """
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes = nnx.to_pure_dict(state)
    pure = random_params(shapes, seed)
    nnx.replace_by_pure_dict(state, pure)
    return graphdef, state, pure


def model_apply(graphdef, state, pure, tokens, positions, segment_ids):
    """Runs the NNX model with parameters taken from the pure dict (differentiable)."""
    state = jax.tree.map(lambda x: x, state)  # a copy, so the caller's stays untouched
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    return model(tokens, positions, segment_ids)


@functools.lru_cache(maxsize=None)
def jitted_model(cfg: ModelConfig):
    """jit(model(tokens, positions, segment_ids)) with build(cfg)'s parameters.
    (The GraphDef is not hashable, so it is closed over rather than static.)"""
    graphdef, state, pure = build(cfg)
    return jax.jit(functools.partial(model_apply, graphdef, state, pure))


def random_ints(seed: int, high: int):
    return jnp.asarray(np.random.default_rng(seed).integers(0, high, (B, T)), jnp.int32)


def packed_batch(seed: int = 0):
    """Row 0: documents of lengths 3, 2, 5, 6 (segments 1..4, positions restart).
    Row 1: a single document over the whole row."""
    tokens = random_ints(100 + seed, SMALL["vocab_size"])
    lengths = [3, 2, 5, 6]
    assert sum(lengths) == T
    seg0 = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)])
    pos0 = np.concatenate([np.arange(n) for n in lengths])
    segment_ids = jnp.asarray(np.stack([seg0, np.ones(T)]), jnp.int32)
    positions = jnp.asarray(np.stack([pos0, np.arange(T)]), jnp.int32)
    return tokens, positions, segment_ids, lengths


def unpacked_batch(seed: int = 0):
    tokens = random_ints(200 + seed, SMALL["vocab_size"])
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    segment_ids = jnp.ones((B, T), jnp.int32)
    return tokens, positions, segment_ids


def strided_batch(seed: int = 0):
    """One segment per row but positions that are not 0, 1, 2, ...: row 0 is
    3 + 7t, row 1 increasing random values below 300. RoPE only sees position
    differences within a segment, so contiguous positions cannot tell whether a
    model uses the positions it is given; these can (and reach the low band)."""
    tokens = random_ints(300 + seed, SMALL["vocab_size"])
    rng = np.random.default_rng(300 + seed)
    row1 = np.sort(rng.choice(300, T, replace=False))
    positions = jnp.asarray(np.stack([3 + 7 * np.arange(T), row1]), jnp.int32)
    return tokens, positions, jnp.ones((B, T), jnp.int32)


def cross_entropy(logits, targets):
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(logz - picked)


def loss_and_grads(forward, pure, targets):
    """(mean cross-entropy, logits, gradients) of `forward` (params -> logits) at `pure`, jitted."""
    def loss(p):
        logits = forward(p)
        return cross_entropy(logits, targets), logits

    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(pure)
    return value, logits, grads


def assert_logits_close(actual, expected, atol=1e-5, rtol=1e-5):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape and actual.dtype == np.float32
    err = np.max(np.abs(actual - expected))
    np.testing.assert_allclose(actual, expected, atol=atol, rtol=rtol,
                               err_msg=f"max abs err {err:.3g}")


def assert_grads_close(actual, expected, tol):
    flat_a = dict(jax.tree_util.tree_flatten_with_path(actual)[0])
    flat_e = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
    assert flat_a.keys() == flat_e.keys()
    for path, e in flat_e.items():
        a, e = np.asarray(flat_a[path]), np.asarray(e)
        scale = np.max(np.abs(e))
        assert scale > 0, f"{jax.tree_util.keystr(path)}: zero gradient, parameter unused?"
        err = np.max(np.abs(a - e))
        assert err <= tol * scale, (
            f"{jax.tree_util.keystr(path)}: max |diff| {err:.3g} > {tol} * max |grad| {scale:.3g}")


# ---------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("name", CONFIGS)
def test_param_layout(name):
    cfg = CONFIGS[name]
    _, _, pure = build(cfg)
    shapes = jax.tree.map(lambda a: tuple(a.shape), pure)
    assert shapes == expected_shapes(cfg)


@pytest.mark.parametrize("batch", ["unpacked", "packed", "strided"])
@pytest.mark.parametrize("name", CONFIGS)
def test_forward_matches_reference(name, batch):
    cfg = CONFIGS[name]
    graphdef, state, pure = build(cfg)
    if batch == "packed":
        tokens, positions, segment_ids, _ = packed_batch()
    elif batch == "strided":
        tokens, positions, segment_ids = strided_batch()
    else:
        tokens, positions, segment_ids = unpacked_batch()
    got = jax.jit(lambda p: model_apply(graphdef, state, p, tokens, positions, segment_ids))(pure)
    want = jax.jit(lambda p: ref.forward(p, tokens, positions, segment_ids, cfg))(pure)
    assert np.std(np.asarray(want)) > 0.1  # not a degenerate comparison
    assert_logits_close(got, want)


@pytest.mark.parametrize("name", CONFIGS)
def test_packing_changes_logits(name):
    """Sanity for the packed tests: the segment mask and position reset matter."""
    cfg = CONFIGS[name]
    apply = jitted_model(cfg)
    tokens, positions, segment_ids, _ = packed_batch()
    packed = apply(tokens, positions, segment_ids)
    plain = apply(tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32))
    # Row 0 differs after its first document; row 1 is a single document either way.
    assert np.max(np.abs(np.asarray(packed[0, 3:] - plain[0, 3:]))) > 1e-2
    np.testing.assert_allclose(packed[0, :3], plain[0, :3], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(packed[1], plain[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_grads_match_reference(name):
    cfg = CONFIGS[name]
    graphdef, state, pure = build(cfg)
    tokens, positions, segment_ids, _ = packed_batch()
    targets = random_ints(7, cfg.vocab_size)

    loss_m, _, grads_m = loss_and_grads(
        lambda p: model_apply(graphdef, state, p, tokens, positions, segment_ids), pure, targets)
    loss_r, _, grads_r = loss_and_grads(
        lambda p: ref.forward(p, tokens, positions, segment_ids, cfg), pure, targets)
    np.testing.assert_allclose(loss_m, loss_r, rtol=1e-6)
    assert_grads_close(grads_m, grads_r, tol=1e-5)


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_document_equals_document_alone(name):
    """Each document of a packed row has the logits it gets alone in its own row."""
    cfg = CONFIGS[name]
    apply = jitted_model(cfg)
    tokens, positions, segment_ids, lengths = packed_batch()
    packed = np.asarray(apply(tokens, positions, segment_ids))
    start = 0
    for n in lengths:
        doc = tokens[0:1, start:start + n]
        alone = apply(doc, jnp.arange(n, dtype=jnp.int32)[None], jnp.ones((1, n), jnp.int32))
        np.testing.assert_allclose(packed[0, start:start + n], np.asarray(alone[0]),
                                   atol=1e-5, rtol=1e-5, err_msg=f"document at {start}:{start + n}")
        # The same document at the start of a full-length row, followed by another one.
        row = jnp.concatenate([doc, tokens[1:2, : T - n]], axis=1)
        pos = jnp.asarray(np.concatenate([np.arange(n), np.arange(T - n)])[None], jnp.int32)
        seg = jnp.asarray(np.concatenate([np.full(n, 5), np.full(T - n, 9)])[None], jnp.int32)
        first = apply(row, pos, seg)
        np.testing.assert_allclose(packed[0, start:start + n], np.asarray(first[0, :n]),
                                   atol=1e-5, rtol=1e-5, err_msg=f"document at {start}:{start + n}")
        start += n


def test_rope_scaling_frequencies():
    c = LLAMA3
    got = np.asarray(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_factor,
                                   c.rope_low_freq_factor, c.rope_high_freq_factor,
                                   c.rope_original_max_length))
    want = ref.reference_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling_factor,
                                  c.rope_low_freq_factor, c.rope_high_freq_factor,
                                  c.rope_original_max_length)
    base = ref.unscaled_inv_freq(c.head_dim, c.rope_theta)
    bands = [ref.llama3_band(f, c.rope_low_freq_factor, c.rope_high_freq_factor,
                             c.rope_original_max_length) for f in base]
    assert set(bands) == {"high", "medium", "low"}, bands  # all three branches exercised
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for f_got, f_base, band in zip(got, base, bands):
        if band == "high":
            np.testing.assert_allclose(f_got, f_base, rtol=1e-6)
        elif band == "low":
            np.testing.assert_allclose(f_got, f_base / c.rope_scaling_factor, rtol=1e-6)
        else:
            assert f_base / c.rope_scaling_factor < f_got < f_base
    # Unscaled (Qwen2) frequencies, and several other head dims / windows.
    np.testing.assert_allclose(np.asarray(rope_inv_freq(QWEN2.head_dim, QWEN2.rope_theta)),
                               ref.unscaled_inv_freq(QWEN2.head_dim, QWEN2.rope_theta), rtol=1e-6)
    for head_dim, orig in [(64, 8192), (128, 8192), (128, 1024), (16, 64)]:
        np.testing.assert_allclose(
            np.asarray(rope_inv_freq(head_dim, 500_000.0, 8.0, 1.0, 4.0, orig)),
            ref.reference_inv_freq(head_dim, 500_000.0, 8.0, 1.0, 4.0, orig), rtol=1e-6,
            err_msg=f"head_dim={head_dim} original_max_length={orig}")


@pytest.mark.parametrize("name", CONFIGS)
def test_remat_policies_match(name):
    base_cfg = CONFIGS[name]
    _, _, pure = build(base_cfg)
    tokens, positions, segment_ids, _ = packed_batch()
    targets = random_ints(7, base_cfg.vocab_size)

    def run(cfg):
        gdef, st, _ = build(cfg)
        _, logits, grads = loss_and_grads(
            lambda p: model_apply(gdef, st, p, tokens, positions, segment_ids), pure, targets)
        return logits, grads

    logits0, grads0 = run(base_cfg)
    for policy in ("full", "dots", "dots_no_batch"):
        logits, grads = run(dataclasses.replace(base_cfg, remat=policy))
        np.testing.assert_allclose(logits, logits0, atol=1e-6, rtol=1e-6, err_msg=policy)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6,
                                                             err_msg=policy), grads, grads0)


def test_packed_segments_gives_each_rows_document_starts_and_lengths():
    from hetjax.models.llama import packed_segments
    rng = np.random.default_rng(0)
    seg = np.cumsum(rng.random((4, 40)) < 0.2, axis=1) + 3  # runs of random lengths
    seg[1] = 7  # a row of one document
    lengths, starts = packed_segments(jnp.asarray(seg), 40)
    for row, ls, ss in zip(seg, np.asarray(lengths), np.asarray(starts)):
        want_starts = [0] + [t for t in range(1, 40) if row[t] != row[t - 1]]
        want_lengths = np.diff(want_starts + [40]).tolist()
        n = len(want_starts)
        assert ss.tolist() == want_starts + [-1] * (41 - n)
        assert ls.tolist() == want_lengths + [-1] * (40 - n)
    # Room for fewer documents than a row holds: the rest merge into the last one.
    lengths, starts = packed_segments(jnp.asarray([[1, 1, 2, 3, 3, 4]]), 2)
    assert starts.tolist() == [[0, 2, -1]] and lengths.tolist() == [[2, 4]]
    # jax reads offsets with room for one document per row as an unpacked layout.
    from hetjax.models.llama import cudnn_packed_attention
    with pytest.raises(ValueError, match="max_documents=1"):
        cudnn_packed_attention(None, None, None, jnp.ones((1, 4), jnp.int32), 1)


def test_remat_dots_keeps_cudnn_attentions_output_so_the_backward_does_not_rerun_it(monkeypatch):
    """remat="dots" saves every matmul's output; XLA's attention is matmuls, cuDNN's fused
    attention is one custom call that checkpoint_dots alone recomputes in the backward
    pass (on an H200 a 1B step took 3.3-4.5% less once it stopped). Traced, not run: no cuDNN here, so its version
    check is skipped; the jaxpr is the one a GPU compiles."""
    import jax._src.cudnn.fused_attention_stablehlo as fused

    monkeypatch.setattr(fused, "check_cudnn_version", lambda *a, **k: None)
    monkeypatch.setattr(fused, "check_compute_capability", lambda *a, **k: True)
    from hetjax.models import llama

    def attention_forwards(policy: str) -> int:
        cfg = dataclasses.replace(LLAMA3, dtype="bfloat16", attention_impl="cudnn", remat=policy, head_dim=16)
        graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
        tokens = jnp.zeros((2, 16), jnp.int32)
        loss = lambda p: nnx.merge(graphdef, p)(tokens).astype(jnp.float32).sum()
        return str(jax.make_jaxpr(jax.grad(loss))(params)).count("dot_product_attention_fwd")

    assert attention_forwards("none") == 1  # the model scans its layers: one call in the body
    assert attention_forwards("dots") == 1
    assert attention_forwards("full") == 2  # remat="full" recomputes it, as it should
    monkeypatch.setitem(llama.REMAT_POLICIES, "dots", jax.checkpoint_policies.checkpoint_dots)
    assert attention_forwards("dots") == 2  # what "dots" did before
