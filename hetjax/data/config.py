"""config.data: where training text comes from and how it becomes batches."""

from __future__ import annotations

import dataclasses

from hetjax.errors import ConfigError

DATA_SOURCES = ("synthetic", "text", "jsonl", "array_record")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Training data (hetjax/data): a source, a tokenizer, packing and grain workers."""

    seed: int = 0  # shuffling, the eval hold-out and the synthetic language
    source: str = "synthetic"  # synthetic | text | jsonl | array_record
    path: str = ""  # text/jsonl: comma-separated files or globs; array_record: prepare's directory
    eval_path: str = ""  # held-out data; empty: hold out eval_fraction of the documents
    eval_fraction: float = 0.01
    text_field: str = "text"  # jsonl: the field that holds a document's text
    tokenizer: str = "byte"  # byte | tokenizer.json | a model directory | SentencePiece or tiktoken model
    bos: str = "auto"  # auto (the tokenizer's convention) | true | false: open each document with BOS
    eos: str = "auto"  # auto | true | false: end each document with EOS (Llama 3: <|end_of_text|>)
    # Named weighted sources instead of source/path: ((name, weight, source, path), ...), e.g.
    # (("web", 0.8, "array_record", "data/web"), ("code", 0.2, "array_record", "data/code")).
    mixture: tuple = ()
    skip_bad_records: bool = False  # skip (and count) bad lines instead of stopping
    index_dir: str = ""  # where text/jsonl indexes are cached; empty: next to the data
    shuffle: bool = True  # a seeded permutation of the documents per epoch
    num_workers: int = 0  # grain worker processes; any number gives the same batches
    start_step: int = 0  # first step to train: its batch and all later ones, as if never stopped
    # The synthetic language (hetjax/data/synthetic.py): a seeded unifilar HMM.
    num_states: int = 32
    branching: int = 8  # tokens each hidden state can emit (Zipf-like probabilities)
    zipf_exponent: float = 1.0
    mean_doc_length: int = 48
    num_documents: int = 100_000  # per split


def validate_data(cfg) -> None:
    """Raises ConfigError for cfg.data (a Config: the checks read the vocabulary and steps)."""
    d = cfg.data
    for key in ("branching", "mean_doc_length", "num_states", "num_documents"):
        if getattr(d, key) <= 0:
            raise ConfigError(f"config.data.{key}={getattr(d, key)}: must be positive")
    if d.source not in DATA_SOURCES:
        raise ConfigError(f"config.data.source={d.source!r}: choose one of {DATA_SOURCES}")
    from hetjax.data import mixture
    mixture.parse(d.mixture)
    for key in ("bos", "eos"):
        if getattr(d, key) not in ("auto", "true", "false"):
            raise ConfigError(f"config.data.{key}={getattr(d, key)!r}: choose auto, true or false")
    if d.mixture and d.eval_path:  # each of a mixture's sources holds out its own share
        raise ConfigError(f"config.data.eval_path={d.eval_path!r} with config.data.mixture: a mixture's "
                          f"sources each hold out config.data.eval_fraction of their documents for eval; "
                          f"drop eval_path, or set config.data.eval_fraction")
    # Settings their source ignores: a run that forgot config.data.source trained on the
    # synthetic language, never saying the path it was given went unread. (A mixture's
    # config.data.source/path are left alone: a config file's own, e.g. tiny_text's, stay set.)
    ignored = [f"{k}={getattr(d, k)!r}" for k in ("path", "eval_path", "tokenizer", "text_field", "skip_bad_records",
                                                  "index_dir", "bos", "eos")
               if d.source == "synthetic" and not d.mixture and getattr(d, k) != getattr(DataConfig, k)]
    if ignored:
        raise ConfigError(f"config.data.{', config.data.'.join(ignored)}: unread, as source='synthetic' makes "
                          f"its own token ids; set config.data.source=text, jsonl or array_record")
    if d.source != "synthetic" and not d.path and not d.mixture:
        raise ConfigError(f"config.data.source={d.source!r} needs config.data.path (files, globs "
                          f"or a prepared directory)")
    if d.source == "synthetic" and d.branching >= cfg.model.vocab_size:
        raise ConfigError(f"config.data.branching={d.branching}: must be below "
                          f"config.model.vocab_size={cfg.model.vocab_size} (token 0 is BOS)")
    from hetjax.data import synthetic
    if d.source == "synthetic" and not synthetic.fits_resolution(d.branching, d.zipf_exponent):
        fits = d.branching // 2
        while fits > 1 and not synthetic.fits_resolution(fits, d.zipf_exponent):
            fits //= 2
        raise ConfigError(f"config.data.branching={d.branching} with zipf_exponent={d.zipf_exponent}: the rarest "
                          f"tokens' probabilities fall below 1/{synthetic.RESOLUTION}, the sampler's unit; use "
                          f"a smaller branching, e.g. {fits}")
    if not 0.0 < d.eval_fraction < 1.0:
        raise ConfigError(f"config.data.eval_fraction={d.eval_fraction}: must lie in (0, 1)")
    for key in ("num_workers", "start_step"):
        if getattr(d, key) < 0:
            raise ConfigError(f"config.data.{key}={getattr(d, key)}: must be >= 0")
    if not 0 <= d.seed < 2**32:
        raise ConfigError(f"config.data.seed={d.seed}: use an integer in [0, 2**32)")
    if d.start_step >= cfg.steps:
        raise ConfigError(f"config.data.start_step={d.start_step}: must be below config.steps={cfg.steps}")
