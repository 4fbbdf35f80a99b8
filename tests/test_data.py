"""The synthetic stream: a function of (seed, step) alone, packed with correct masks."""

import jax
import numpy as np

from hetjax import data, step
from hetjax.config import DEFAULT_RULES, MeshConfig
from hetjax.mesh import make_mesh


def test_rows_depend_only_on_seed_step_and_row():
    s = data.SyntheticStream(64, 32, seed=3)
    whole = s.rows(5, 0, 8)
    parts = [s.rows(5, i, i + 2) for i in range(0, 8, 2)]
    for k in whole:
        np.testing.assert_array_equal(whole[k], np.concatenate([p[k] for p in parts]))
    assert not np.array_equal(s.rows(6, 0, 8)["inputs"], whole["inputs"])
    assert not np.array_equal(data.SyntheticStream(64, 32, seed=4).rows(5, 0, 8)["inputs"], whole["inputs"])
    assert not np.array_equal(s.rows(5, 0, 8, split=1)["inputs"], whole["inputs"])


def test_the_global_batch_is_the_same_on_every_mesh():
    s = data.SyntheticStream(64, 32, seed=0)
    expected = s.rows(2, 0, 8)
    for mesh_cfg, n in [(MeshConfig(fsdp=1), 1), (MeshConfig(fsdp=8), 8),
                        (MeshConfig(data=2, fsdp=2, tensor=2), 8)]:
        mesh = make_mesh(mesh_cfg, jax.devices()[:n])
        batch = data.global_batch(s, 2, 8, step.batch_shardings(mesh, DEFAULT_RULES))
        for k, v in expected.items():
            np.testing.assert_array_equal(np.asarray(batch[k]), v)


def test_packing_invariants():
    rows = data.SyntheticStream(64, 256, seed=1, mean_doc_length=16).rows(0, 0, 4)
    seg, pos, inp, tgt, mask = (rows[k] for k in ("segment_ids", "positions", "inputs", "targets", "loss_mask"))
    assert (seg[:, 1:] >= seg[:, :-1]).all() and seg.max() > 2  # several documents per row
    starts = np.diff(seg, axis=1, prepend=0) > 0
    assert (pos[starts] == 0).all() and (inp[starts] == data.synthetic.BOS).all()
    np.testing.assert_array_equal(pos[~starts], (np.roll(pos, 1, axis=1) + 1)[~starts])
    np.testing.assert_array_equal(inp[:, 1:], tgt[:, :-1])
    # Targets that open the next document are not scored; every other target is.
    assert (mask[:, :-1] == (seg[:, 1:] == seg[:, :-1])).all()
    # Inside a document, every transition is one the chain allows.
    s = data.SyntheticStream(64, 256, seed=1, mean_doc_length=16)
    scored = (mask == 1) & (inp != data.synthetic.BOS)
    allowed = (s.successors[inp] == tgt[..., None]).any(-1)
    assert allowed[scored].all()
