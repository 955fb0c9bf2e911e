"""The data of the images example: handwritten digits as PNG files, decoded in `data.preprocess`.

* `python digits_png.py OUT_DIR`: renders scikit-learn's 1,797 handwritten digits (8x8,
  no download) as 16x16 grayscale PNG images (Pillow, bilinear upscaling) and writes them
  as encoded PNG bytes with their integer label — columns `png` and `label` — to
  `OUT_DIR/train.parquet` and `OUT_DIR/val.parquet` (a fixed, seeded 20% validation split).
* `decode(batch)`: `data.preprocess`. Ray Data runs it with `map_batches` on its CPU tasks,
  before training: PNG bytes -> `image` (N, 1, 16, 16) float32, normalised with the
  training set's mean and standard deviation; `label` passes through, `png` is dropped.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np

SIDE = 16
MEAN, STD = 0.3050, 0.3185  # of the rendered training images' pixels in [0, 1]; `stats()` recomputes them


def decode(batch: dict) -> dict:
    """`data.preprocess`: encoded PNG bytes -> normalised float32 images (channels first)."""
    from PIL import Image

    pixels = np.stack([np.asarray(Image.open(io.BytesIO(bytes(png))).convert("L")) for png in batch["png"]])
    image = (pixels.astype(np.float32) / 255.0 - MEAN) / STD
    return {"image": image[:, None, :, :], "label": np.asarray(batch["label"], dtype=np.int64)}


def render(image_8x8: np.ndarray) -> bytes:
    """One digit (intensities 0..16) as the bytes of a 16x16 grayscale PNG file."""
    from PIL import Image

    small = Image.fromarray((image_8x8 * (255 / 16)).round().astype(np.uint8), mode="L")
    out = io.BytesIO()
    small.resize((SIDE, SIDE), Image.Resampling.BILINEAR).save(out, format="PNG")
    return out.getvalue()


def write(out_dir: Path, val_fraction: float = 0.2, seed: int = 0) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    n_val = int(round(len(order) * val_fraction))
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name, idx in (("val", order[:n_val]), ("train", order[n_val:])):
        table = pa.table({"png": pa.array([render(digits.images[i]) for i in idx], pa.binary()),
                          "label": pa.array(digits.target[idx].astype(np.int64))})
        pq.write_table(table, out_dir / f"{name}.parquet")
        rows[name] = table.num_rows
    return rows


def stats(path: Path) -> tuple[float, float]:
    """Mean and standard deviation of the pixels (in [0, 1]) of a parquet file of PNGs."""
    import pyarrow.parquet as pq
    from PIL import Image

    pngs = pq.read_table(path, columns=["png"]).column("png").to_pylist()
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(p))) for p in pngs]).astype(np.float64) / 255.0
    return float(pixels.mean()), float(pixels.std())


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/data/digits-png")
    print(f"wrote {out}: {write(out)} rows")
