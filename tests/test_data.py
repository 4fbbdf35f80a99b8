"""The data pipeline: packing against a plain-Python reference, layout-independent
batches, exact resume, attention confined to documents, the synthetic floor."""

import dataclasses
import json
import os
import math
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from hetjax import data, program
from hetjax.config import DEFAULT_RULES, Config, DataConfig, MeshConfig, ModelConfig
from hetjax.data import packing, pipeline, synthetic
from hetjax.mesh import make_mesh
from hetjax.models.llama import Decoder

BOS = 99


class ListSource:
    """Documents held in a list: the reference needs nothing else."""

    def __init__(self, docs):
        self.docs = [np.asarray(d, np.int32) for d in docs]
        self.lengths = np.array([len(d) for d in docs])

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]


def reference_rows(docs, seq_len, seed, num_rows):
    """Plain Python: permute per epoch, concatenate BOS+doc, cut rows of seq_len+1
    overlapping by one token, then number segments and positions token by token."""
    stream, is_start, epoch = [], [], 0
    while len(stream) < num_rows * seq_len + 1:
        order = np.random.default_rng([seed, 0, 0xE0C, epoch]).permutation(len(docs))
        for i in order:
            stream += [BOS] + list(docs[i])
            is_start += [True] + [False] * len(docs[i])
        epoch += 1
    out = {k: [] for k in packing.KEYS}
    for g in range(num_rows):
        tok = stream[g * seq_len:g * seq_len + seq_len + 1]
        st = is_start[g * seq_len:g * seq_len + seq_len + 1]
        seg, pos, segs, poss = 1, 0, [], []
        for t in range(seq_len + 1):
            if st[t] and t > 0:
                seg, pos = seg + 1, 0
            segs.append(seg)
            poss.append(pos)
            pos += 1
        out["inputs"].append(tok[:-1])
        out["targets"].append(tok[1:])
        out["positions"].append(poss[:-1])
        out["segment_ids"].append(segs[:-1])
        out["loss_mask"].append([0 if s else 1 for s in st[1:]])
    return {k: np.array(v, np.int32) for k, v in out.items()}


def random_docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 50, rng.integers(0, 30)) for _ in range(n)]


def test_packing_matches_a_plain_python_reference_across_epochs():
    docs, T = random_docs(23), 16
    packed = packing.PackedRows(ListSource(docs), [len(d) for d in docs], T, seed=5, bos_id=BOS)
    epoch_rows = (sum(len(d) + 1 for d in docs)) // T
    n = 3 * epoch_rows + 2  # three epochs and a bit
    expected = reference_rows(docs, T, 5, n)
    got = packed.rows(np.arange(n))
    for k in packing.KEYS:
        np.testing.assert_array_equal(got[k], expected[k], err_msg=k)
    # Random access: any subset, in any order, gives the same rows.
    pick = np.array([n - 1, 3, epoch_rows, 0])
    for k in packing.KEYS:
        np.testing.assert_array_equal(packed.rows(pick)[k], expected[k][pick], err_msg=k)


def test_packing_neither_drops_nor_duplicates_a_token():
    docs, T = random_docs(40, seed=1), 8
    packed = packing.PackedRows(ListSource(docs), [len(d) for d in docs], T, seed=0, bos_id=BOS)
    total = sum(len(d) + 1 for d in docs)
    rows = packed.rows(np.arange(total // T))
    stream = rows["inputs"].reshape(-1)
    # One epoch's inputs are exactly the documents, each once, each whole.
    order = np.random.default_rng([0, 0, 0xE0C, 0]).permutation(len(docs))
    expected = np.concatenate([np.r_[BOS, docs[i]] for i in order])[:len(stream)]
    np.testing.assert_array_equal(stream, expected)
    np.testing.assert_array_equal(rows["targets"][:, :-1], rows["inputs"][:, 1:])
    np.testing.assert_array_equal(rows["targets"][:-1, -1], rows["inputs"][1:, 0])
    # Every token but a BOS is scored; a BOS never is.
    assert ((rows["loss_mask"] == 1) == (rows["targets"] != BOS)).all()


def test_attention_never_crosses_a_document_boundary():
    """Through the model itself: changing one document's tokens changes the
    logits of that document's positions only."""
    docs, T = random_docs(12, seed=2), 32
    packed = packing.PackedRows(ListSource(docs), [len(d) for d in docs], T, seed=1, bos_id=BOS)
    rows = packed.rows(np.arange(4))
    model = Decoder(ModelConfig(vocab_size=128, num_layers=2, embed_dim=32, mlp_dim=64),
                    rngs=nnx.Rngs(0))
    seg = rows["segment_ids"]
    assert seg.max() >= 3
    graphdef, params = nnx.split(model)
    logits = jax.jit(lambda x: nnx.merge(graphdef, params)(x, rows["positions"], seg))
    base = logits(rows["inputs"])
    for target in (1, 2):
        out = logits(np.where(seg == target, (rows["inputs"] + 7) % 128, rows["inputs"]))
        same = np.isclose(np.asarray(out), np.asarray(base), atol=1e-6).all(-1)
        np.testing.assert_array_equal(same, seg != target)


def test_synthetic_floor_matches_a_monte_carlo_estimate():
    """The closed form against the true model's loss on sampled documents, replayed
    through the automaton: within 4 standard errors (about 1e-2 nats here)."""
    lang = synthetic.SyntheticLanguage(64, seed=7, num_states=8, branching=6, mean_doc_length=20,
                                       num_documents=4000)
    src = lang.source("eval")
    logp = np.log(np.where(lang.emit > 0, lang.emit, 1.0))
    sums, counts = [], []
    for i in range(len(src)):
        s, total, doc = 0, 0.0, src[i]
        for x in doc.tolist():
            total -= logp[s, x]
            s = lang.next[s, x]
        sums.append(total)
        counts.append(len(doc))
    sums, counts = np.array(sums), np.array(counts, float)
    mean = sums.sum() / counts.sum()
    se = math.sqrt(np.var(sums - mean * counts, ddof=1) / len(sums)) / counts.mean()
    assert abs(counts.mean() - 20) < 4 * 20 / math.sqrt(len(counts))  # geometric, mean 20
    assert abs(mean - lang.floor()) < 4 * se, (mean, lang.floor(), se)
    assert se < 0.01
    # The floor is not just one state's entropy: states differ, and the start matters.
    assert np.ptp(lang.state_entropies()) > 0.1 and abs(lang.floor() - lang.entropy_rate()) > 1e-4


def test_the_same_seed_gives_the_same_corpus():
    a = synthetic.SyntheticLanguage(256, seed=3).source("train")
    b = synthetic.SyntheticLanguage(256, seed=3).source("train")
    c = synthetic.SyntheticLanguage(256, seed=4).source("train")
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_array_equal(a[17], b[17])
    assert not np.array_equal(a.lengths[:50], c.lengths[:50])


CFG = Config(model=ModelConfig(vocab_size=64), batch_size=8, seq_len=24, steps=10,
             data=DataConfig(seed=2, mean_doc_length=10, num_documents=500))


def reference_batches(d, steps):
    return [d.train.rows(np.arange(s * 8, s * 8 + 8)) for s in steps]


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_the_same_on_every_mesh_and_worker_count(workers):
    d = data.build(CFG)
    expected = reference_batches(d, range(4))
    meshes = [MeshConfig(data=1, fsdp=8), MeshConfig(data=4, fsdp=2), MeshConfig(data=4, tensor=2, fsdp=1)]
    for mesh_cfg in meshes[1:2] if workers else meshes:  # worker start-up is slow
        sh = program.batch_shardings(make_mesh(mesh_cfg), DEFAULT_RULES)
        it = pipeline.DataIterator(d.train, 8, sh, fingerprint=d.fingerprint, num_workers=workers)
        try:
            for exp in expected:
                batch = next(it)
                for k in packing.KEYS:
                    np.testing.assert_array_equal(np.asarray(batch[k]), exp[k], err_msg=(mesh_cfg, k))
        finally:
            it.close()



# A trainer holding a worker iterator (`python SCRIPT`): it takes batches 0-1, says which
# processes are its grain workers, and after a Ctrl-C (handled as hetjax.train does:
# noted, acted on later) takes batches 2-5 and checks them against the reference.
_TRAINER = """
import os, signal, sys, time
import numpy as np
from hetjax import data, program
from hetjax.config import DEFAULT_RULES, MeshConfig
from hetjax.data import packing, pipeline
from hetjax.mesh import make_mesh
from tests.test_data import CFG, reference_batches

def main():
    d = data.build(CFG)
    sh = program.batch_shardings(make_mesh(MeshConfig(data=-1, fsdp=1)), DEFAULT_RULES)
    it = pipeline.DataIterator(d.train, 8, sh, fingerprint=d.fingerprint, num_workers=2)
    stopped = []
    signal.signal(signal.SIGINT, lambda *_: stopped.append(1))
    expected = reference_batches(d, range(6))
    got = [next(it) for _ in range(2)]
    me = str(os.getpid())
    workers = [p for p in os.listdir("/proc") if p.isdigit() and p != me
               and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1] == me
               and b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()
               and b"resource_tracker" not in open(f"/proc/{p}/cmdline", "rb").read()]
    print("workers", *workers, flush=True)
    while not stopped:
        time.sleep(0.05)
    got += [next(it) for _ in range(4)]
    for batch, exp in zip(got, expected):
        for k in packing.KEYS:
            np.testing.assert_array_equal(np.asarray(batch[k]), exp[k])
    it.close()
    print("six batches after Ctrl-C", flush=True)


if __name__ == "__main__":  # grain's workers are spawned: they import this file
    main()
"""


def _start_trainer(tmp_path):
    import subprocess, sys
    script = tmp_path / "trainer.py"
    script.write_text(_TRAINER)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, str(script)], cwd=root, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(root)})
    import select
    if not select.select([proc.stdout], [], [], 120)[0]:
        os.killpg(proc.pid, 9)
        raise AssertionError("the trainer script said nothing in 120 s")
    line = proc.stdout.readline()
    assert line.startswith("workers"), line + proc.stdout.read()
    workers = [int(p) for p in line.split()[1:]]
    assert len(workers) == 2, line
    return proc, workers


def test_grain_workers_leave_a_ctrl_c_to_the_trainer_and_end_with_it(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group. The workers used to die of it
    with a KeyboardInterrupt traceback each, leaving the trainer, which saves before it
    stops, without its batches. And a trainer killed outright left its workers running."""
    import signal
    proc, _ = _start_trainer(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal does: every process of the group
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and "six batches after Ctrl-C" in out, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out

    proc, workers = _start_trainer(tmp_path)
    proc.kill()  # SIGKILL: no chance to close its iterator
    proc.wait()
    deadline = time.monotonic() + 30
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [w for w in workers if os.path.exists(f"/proc/{w}")
                 and open(f"/proc/{w}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        time.sleep(0.1)
    assert not alive, f"grain workers {alive} outlived their killed trainer"


def test_restoring_the_state_continues_exactly():
    d = data.build(CFG)
    sh = program.batch_shardings(make_mesh(MeshConfig(data=2, fsdp=4)), DEFAULT_RULES)
    it = d.iterator(sh)
    whole = [jax.device_get(next(it)) for _ in range(6)]
    it.close()
    it = d.iterator(sh)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    it.close()
    resumed = d.iterator(sh)
    resumed.set_state(state)
    for expected in whole[3:]:
        got = jax.device_get(next(resumed))
        for k in packing.KEYS:
            np.testing.assert_array_equal(got[k], expected[k])
    # A state from other data is refused.
    other = data.build(CFG.__class__(**{**CFG.__dict__, "seq_len": 32}))
    with pytest.raises(Exception, match="restore with the config"):
        other.iterator(program.batch_shardings(make_mesh(MeshConfig(data=2, fsdp=4)), DEFAULT_RULES)).set_state(state)
    resumed.close()


def test_starting_far_into_training_costs_no_more_than_starting_at_zero():
    d = data.build(CFG)
    sh = program.batch_shardings(make_mesh(MeshConfig(fsdp=8)), DEFAULT_RULES)
    seconds = {}
    for start in (0, 10**9):
        t = time.perf_counter()
        it = d.iterator(sh, start_step=start)
        batch = next(it)
        seconds[start] = time.perf_counter() - t
        it.close()
        np.testing.assert_array_equal(np.asarray(batch["inputs"]),
                                      d.train.rows(np.arange(8) + start * 8)["inputs"])
    assert seconds[10**9] < 5 * seconds[0] + 0.5, seconds


def test_a_batch_split_over_its_length_too_holds_the_same_rows():
    """Sequence sharding (rules mapping `length` to tensor) failed at the first batch with
    jax's IndivisibleError: the rows a process holds were looked up with one column."""
    d = data.build(CFG)
    rules = tuple((k, "tensor" if k == "length" else v) for k, v in DEFAULT_RULES)
    split = program.batch_shardings(make_mesh(MeshConfig(fsdp=4, tensor=2)), rules)
    plain = program.batch_shardings(make_mesh(MeshConfig(fsdp=8)), DEFAULT_RULES)
    assert split["inputs"].spec[1] == "tensor"
    a, b = d.batch(3, split), d.batch(3, plain)
    for key in b:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
    it = d.iterator(split, start_step=3)
    np.testing.assert_array_equal(np.asarray(next(it)["inputs"]), d.train.rows(np.arange(8) + 3 * 8)["inputs"])
    it.close()


def test_eval_batches_are_fixed_and_held_out():
    d = data.build(CFG)
    sh = program.batch_shardings(make_mesh(MeshConfig(fsdp=8)), DEFAULT_RULES)
    a, b = d.eval_batch(1, sh), d.eval_batch(1, sh)
    np.testing.assert_array_equal(np.asarray(a["inputs"]), np.asarray(b["inputs"]))
    assert not np.array_equal(np.asarray(a["inputs"]), np.asarray(d.batch(1, sh)["inputs"]))


def test_an_hf_tokenizer_encodes_special_token_text_as_text_and_counts_its_highest_id(tmp_path):
    """A document quoting "<|endoftext|>" got a real EOS in its middle (tiktoken's files
    encode it as text); and a vocabulary whose ids skip some (0, 1, 2, 900) reported 4 ids,
    so the model's vocab_size check let id 900 through to a 10-row embedding."""
    import json as json_lib

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from hetjax.config import ConfigError
    from hetjax.data import tokenizers
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
    tok.train_from_iterator(["a document of words"] * 8, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    t = tokenizers.load(str(tmp_path / "tokenizer.json"))
    quoted = "a document quoting <|endoftext|> in its text"
    assert t.eos_id == 0 and t.eos_id not in t.encode(quoted).tolist()
    assert t.decode(t.encode(quoted)).strip() == quoted
    assert [x.tolist() for x in t.encode_batch([quoted])] == [t.encode(quoted).tolist()]
    sparse = {"model": {"type": "WordLevel", "vocab": {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 900},
                        "unk_token": "<unk>"}, "pre_tokenizer": {"type": "Whitespace"}}
    (tmp_path / "sparse.json").write_text(json_lib.dumps(sparse))
    t = tokenizers.load(str(tmp_path / "sparse.json"))
    assert t.encode("hello world").tolist() == [2, 900] and t.vocab_size == 901
    with pytest.raises(ConfigError, match="has 901 token ids but config.model.vocab_size=10"):
        tokenizers.check_vocab(t, 10, "config.data.tokenizer")


def test_an_hf_tokenizer_saved_with_truncation_and_padding_encodes_whole_documents(tmp_path):
    """A tokenizer.json saved after a call with truncation and padding keeps them: every
    document was cut to 8 tokens and padded to its batch's longest, without a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from hetjax.data import tokenizers
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a document of words"] * 8, trainers.BpeTrainer(
        vocab_size=60, special_tokens=["<pad>"], initial_alphabet=list("abcdefghijklmnopqrstuvwxyz")))
    tok.save(str(tmp_path / "plain.json"))
    tok.enable_truncation(8)
    tok.enable_padding(pad_id=0, pad_token="<pad>")
    tok.save(str(tmp_path / "cut.json"))
    plain, cut = (tokenizers.load(str(tmp_path / f)) for f in ("plain.json", "cut.json"))
    long, short = " ".join(["document words"] * 10), "a word"
    assert len(plain.encode(long)) > 8
    assert cut.encode(long).tolist() == plain.encode(long).tolist()
    assert [x.tolist() for x in cut.encode_batch([long, short])] == [plain.encode(long).tolist(),
                                                                     plain.encode(short).tolist()]
    assert cut.fingerprint != plain.fingerprint and plain.fingerprint.startswith("hf2-")  # old runs resume


def test_data_settings_their_source_ignores_are_refused():
    """Forgetting config.data.source=jsonl trained on the synthetic language, the path,
    eval_path and tokenizer given unread."""
    from hetjax.config import Config, ConfigError, DataConfig, validate
    for given in (dict(path="web/*.jsonl"), dict(eval_path="held.jsonl"), dict(tokenizer="tok.json"),
                  dict(eos="true"), dict(bos="false"), dict(text_field="body"), dict(skip_bad_records=True),
                  dict(index_dir="/nonexistent")):
        with pytest.raises(ConfigError, match=rf"config.data.{next(iter(given))}=.*unread, as source='synthetic' .*"
                                              r"set config.data.source=text, jsonl or array_record"):
            validate(Config(data=DataConfig(**given)))
    # A mixture's own sources are read; a config file's source and path may stay set (tiny_text's).
    validate(Config(data=DataConfig(mixture=(("a", 1.0, "jsonl", "x"),), path="data/tiny_text", source="array_record",
                                    tokenizer="tok.json")))
    validate(Config(data=DataConfig(source="jsonl", path="web/*.jsonl", tokenizer="tok.json")))  # read
    # A branching whose rare tokens fall below the sampler's 1/4096 was numpy's "repeats may
    # not contain negative values" when the data was built.
    with pytest.raises(ConfigError, match=r"config.data.branching=2000 with zipf_exponent=1.0: the rarest tokens' "
                                          r"probabilities fall below 1/4096, .* e.g. 1000"):
        validate(Config(data=DataConfig(branching=2000), model=dataclasses.replace(Config().model, vocab_size=8192)))
