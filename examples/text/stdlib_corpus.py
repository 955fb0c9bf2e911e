"""The corpus of the text example: the Python standard library's own source files.

Three things a user writes around a language model, in one module:

* `python stdlib_corpus.py build OUT_DIR`: every top-level `*.py` file of this Python's
  standard library (no download; it ships with every installation), one row per file
  (`path`, `text` as bytes), split by file into `OUT_DIR/train.parquet` and
  `OUT_DIR/val.parquet` (every 16th file, sorted by name, is validation). It also
  writes `OUT_DIR/baseline.json`: the unigram entropy of exactly the bytes the model is
  scored on in the validation split (the labels of `blocks(val)`), in bits per byte —
  what the best context-free model of that split would reach.
* `blocks(batch)`: `data.preprocess`. Ray Data runs it with `map_batches` on its CPU
  tasks: each file's bytes are cut into non-overlapping blocks of `CONTEXT + 1` bytes
  (the remainder of each file is dropped), giving `input_ids` (the first `CONTEXT`
  bytes) and `labels` (the same bytes shifted by one).
* `python stdlib_corpus.py report RUN_DIR OUT_DIR`: the run's validation loss in bits
  per byte next to that baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
from pathlib import Path

import numpy as np

CONTEXT = 128  # bytes of context; each block holds CONTEXT + 1 bytes
VAL_EVERY = 16  # every 16th file (sorted by name) is a validation file


def blocks(batch: dict) -> dict:
    """`data.preprocess`: one row per file in, one row per block of CONTEXT + 1 bytes out."""
    cut = []
    for text in batch["text"]:
        data = np.frombuffer(bytes(text), dtype=np.uint8)
        n = len(data) // (CONTEXT + 1)
        cut.append(data[: n * (CONTEXT + 1)].reshape(n, CONTEXT + 1))
    tokens = np.concatenate(cut).astype(np.int64) if cut else np.zeros((0, CONTEXT + 1), np.int64)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def stdlib_files(max_files: int | None = None) -> list[Path]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(lib.glob("*.py"))
    return files[:max_files] if max_files else files


def build(out_dir: Path, max_files: int | None = None) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir.mkdir(parents=True, exist_ok=True)
    files = stdlib_files(max_files)
    splits: dict[str, list[Path]] = {"train": [], "val": []}
    for i, path in enumerate(files):
        splits["val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"].append(path)
    summary = {}
    for name, paths in splits.items():
        table = pa.table({"path": [p.name for p in paths], "text": [p.read_bytes() for p in paths]})
        pq.write_table(table, out_dir / f"{name}.parquet")
        summary[f"{name}_files"] = len(paths)
        summary[f"{name}_bytes"] = int(sum(len(t) for t in table.column("text").to_pylist()))
    val_labels = blocks({"text": pq.read_table(out_dir / "val.parquet").column("text").to_pylist()})["labels"]
    summary["val_scored_bytes"] = int(val_labels.size)
    summary["unigram_bits_per_byte"] = unigram_bits(val_labels)
    (out_dir / "baseline.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def unigram_bits(labels: np.ndarray) -> float:
    """Entropy (bits) of the byte distribution of `labels`: a unigram model fit to them."""
    counts = np.bincount(labels.reshape(-1), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def report(run_dir: Path, out_dir: Path) -> dict:
    baseline = json.loads((out_dir / "baseline.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    bits = summary["final_metrics"]["val_loss"] / math.log(2)
    return {"val_bits_per_byte": round(bits, 3), "unigram_bits_per_byte": round(baseline["unigram_bits_per_byte"], 3),
            "steps": summary["steps"], "elapsed_s": summary["elapsed_s"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="write train/val parquet and baseline.json")
    b.add_argument("out_dir", type=Path)
    b.add_argument("--max-files", type=int, default=None, help="only the first N files (tests)")
    r = sub.add_parser("report", help="validation bits per byte next to the unigram baseline")
    r.add_argument("run_dir", type=Path)
    r.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "build":
        print(json.dumps(build(args.out_dir, args.max_files)))
    else:
        print(json.dumps(report(args.run_dir, args.out_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
