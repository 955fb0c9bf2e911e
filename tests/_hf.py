"""A user's Hugging Face project, as a user would write it: a `transformers`
`BertForSequenceClassification` built from a tiny `BertConfig` (random init, no download),
dict batches `input_ids` / `attention_mask` / `labels` from parquet (`data.inputs`), and
`train.loss: model` (the model computes its loss from `labels=`).

The task: label 1 when the sequence holds token 7 -- learnable within a few dozen steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SEQ, VOCAB = 12, 100

FACTORY = '''
from transformers import BertConfig, BertForSequenceClassification


def config(**overrides):
    base = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=32, num_labels=2)
    return BertConfig(**{**base, **overrides})


def build(spec, **overrides):
    return BertForSequenceClassification(config(**overrides))
'''


def rows(n: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    ids = rng.integers(8, VOCAB, size=(n, SEQ))
    labels = rng.integers(0, 2, size=n)
    where = rng.integers(1, SEQ, size=n)
    ids[labels == 1, where[labels == 1]] = 7
    ids[:, 0] = 1  # [CLS]
    lengths = rng.integers(SEQ // 2, SEQ + 1, size=n)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.where(mask == 1, ids, 0)
    labels = np.where((ids == 7).any(axis=1), 1, 0)  # a 7 beyond the padding does not count
    as_list = lambda a: pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1), pa.int64()), SEQ)  # noqa: E731
    return pa.table({"input_ids": as_list(ids), "attention_mask": as_list(mask),
                     "labels": pa.array(labels, pa.int64())})


def write_project(root: Path, train_rows: int = 256, val_rows: int = 64, **run: str) -> Path:
    """`root/hf_bert.py`, `root/data/{train,val}.parquet` and `root/config.yaml`; returns the config's path."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "hf_bert.py").write_text(FACTORY)
    (root / "data").mkdir(exist_ok=True)
    pq.write_table(rows(train_rows, 0), root / "data" / "train.parquet")
    pq.write_table(rows(val_rows, 1), root / "data" / "val.parquet")
    config = root / "config.yaml"
    config.write_text(f"""\
name: hf
model:
  name: "hf_bert:build"
  kwargs: {{hidden_dropout_prob: 0.0, attention_probs_dropout_prob: 0.0}}
data:
  source: parquet
  path: {root / "data" / "train.parquet"}
  val_path: {root / "data" / "val.parquet"}
  inputs: [input_ids, attention_mask, labels]
  label: labels
train:
  loss: model
  epochs: 1
  global_batch_size: 16
  micro_batch_size: 8
  lr: 0.003
  warmup_steps: 2
parallel:
  strategy: bucketed
scaling:
  num_workers: 2
run:
  storage_path: {root / "runs"}
""")
    return config
