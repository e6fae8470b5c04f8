"""The simulated workload: a catalogue of images, a skewed request stream, a real processor.

Everything here is deterministic in ``seed``, so every cache mode of a ``--compare`` run sees
the same requests, the same image bytes and the same tensors.  Nothing grows with the number
of requests: P0 draws them one at a time and makes each image's upload when it is needed.

- :class:`Catalogue` makes each image's *encoded bytes* on first use (what a client uploads):
  a PNG-like container, rows delta-filtered and deflated, of a smooth random picture whose size
  varies per image; it keeps the most recent uploads up to a byte budget.
- :func:`request_stream` draws requests of 1 to ``max_items`` distinct images from a Zipf
  popularity over the catalogue.  Every host of a multi-host run shares the catalogue and the
  popularity ranking and draws its own requests (``host``).
- :func:`process` is the vision processor P0 runs on a miss: decode, antialiased resize to
  448×448, normalise, channels first. Its output mirrors a vision model's: ``pixel_values``
  (float32, 3×448×448) and ``image_sizes`` (int64, the original height and width).
- :func:`tensor_digests` is the truth each worker checks what it receives against.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

#: Side of the square model input, in pixels (a 448×448 crop, as in several VLMs).
TARGET_SIDE = 448
#: Patch side and merge factor used to count an image's placeholder tokens.
_PATCH, _MERGE = 14, 2
#: CLIP's normalisation constants, per RGB channel.
_MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32).reshape(3, 1, 1)
_STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32).reshape(3, 1, 1)
_MAGIC = b"MMIMG1"
_HEADER = struct.Struct("<6sII")


def encode_image(pixels: np.ndarray) -> bytes:
    """Encode an ``H×W×3`` uint8 picture: horizontal deltas per row (PNG's Sub filter), deflated."""
    height, width, _ = pixels.shape
    deltas = np.diff(pixels, axis=1, prepend=np.zeros((height, 1, 3), np.uint8))
    return _HEADER.pack(_MAGIC, height, width) + zlib.compress(deltas.tobytes(), 1)


def decode_image(data: bytes) -> np.ndarray:
    """Inverse of :func:`encode_image`: inflate, then undo the row deltas (wrapping uint8 sums)."""
    magic, height, width = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("not an image made by mmcache's simulated catalogue")
    raw = zlib.decompress(data[_HEADER.size :])
    deltas = np.frombuffer(raw, np.uint8).reshape(height, width, 3)
    return np.cumsum(deltas, axis=1, dtype=np.uint8)


class Catalogue:
    """``size`` distinct images, each generated from ``(seed, index)`` on first use; the most
    recently used uploads are kept up to ``keep_bytes``.

    Sides vary between 384 and 1280 pixels, so processing cost varies per image as it does
    for real uploads.
    """

    def __init__(self, size: int, seed: int, *, keep_bytes: int = 256 << 20) -> None:
        self.size = size
        self.seed = seed
        self._keep_bytes = keep_bytes
        self._kept_bytes = 0
        self._encoded: OrderedDict[int, bytes] = OrderedDict()

    def __getitem__(self, index: int) -> bytes:
        """The encoded bytes of image ``index`` (the same bytes every time)."""
        data = self._encoded.get(index)
        if data is not None:
            self._encoded.move_to_end(index)
            return data
        data = encode_image(self._picture(index))
        self._encoded[index] = data
        self._kept_bytes += len(data)
        while self._kept_bytes > self._keep_bytes and len(self._encoded) > 1:
            self._kept_bytes -= len(self._encoded.popitem(last=False)[1])
        return data

    def _picture(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, index])
        height = int(rng.integers(384, 961))
        width = int(rng.integers(512, 1281))
        # A coarse random field upsampled by repetition (flat regions and sharp edges) over a
        # diagonal gradient: distinct per image, and it deflates well, as photos compress.
        coarse = rng.integers(0, 192, size=(height // 32 + 1, width // 32 + 1, 3), dtype=np.uint8)
        blocks = np.repeat(np.repeat(coarse, 32, axis=0), 32, axis=1)[:height, :width]
        down = (np.arange(height) * 32 // height).astype(np.uint8)
        across = (np.arange(width) * 32 // width).astype(np.uint8)
        return blocks + (down[:, None] + across[None, :])[:, :, None]


def request_stream(
    *, requests: int, catalogue: int, zipf: float, max_items: int, seed: int, host: int = 0
) -> Iterator[list[int]]:
    """Yield ``requests`` requests, each a list of 1 to ``min(max_items, catalogue)`` distinct
    image indices.

    Popularity follows Zipf's law with exponent ``zipf`` over a seeded random ranking of the
    catalogue (0 gives a uniform popularity; larger values concentrate on fewer images); the
    ranking depends on ``seed`` only, the draws on ``seed`` and ``host``.  Memory is linear in
    ``catalogue`` and constant in ``requests``.
    """
    ranking = np.random.default_rng([seed, 0x5EED]).permutation(catalogue)
    # Weights in log space: no overflow or underflow for any exponent the CLI accepts.
    log_weights = -zipf * np.log(np.arange(1, catalogue + 1, dtype=np.float64))
    cumulative = np.cumsum(np.exp(log_weights - log_weights.max()))
    cumulative /= cumulative[-1]
    rng = np.random.default_rng([seed, 0x5EED, host])
    for _ in range(requests):
        count = int(rng.integers(1, min(max_items, catalogue) + 1))
        yield [int(ranking[rank]) for rank in _distinct_ranks(rng, cumulative, count)]


def _distinct_ranks(rng: np.random.Generator, cumulative: np.ndarray, count: int) -> list[int]:
    """``count`` distinct ranks drawn by popularity: draws that repeat an earlier rank are
    redrawn (which is drawing without replacement), a bounded number of times; should the
    popularity be so concentrated that distinct draws do not come, the most popular ranks
    not yet drawn complete the request."""
    chosen: dict[int, None] = {}
    for _ in range(64 * count):
        drawn = int(np.searchsorted(cumulative, rng.random(), side="right"))
        rank = min(drawn, len(cumulative) - 1)
        chosen[rank] = None
        if len(chosen) == count:
            return list(chosen)
    rank = 0
    while len(chosen) < count:
        chosen.setdefault(rank, None)
        rank += 1
    return list(chosen)


@dataclass(frozen=True)
class ProcessedImage:
    """What the processor makes of one image: the tensors and the prompt update."""

    tensors: dict[str, np.ndarray]
    #: Small metadata describing the item's placeholder tokens (never counted in its size).
    prompt_update: dict[str, object]


def _resize_weights(n_in: int, n_out: int) -> np.ndarray:
    """Row-stochastic ``n_out × n_in`` matrix of an antialiased linear (triangle) filter."""
    scale = n_in / n_out
    support = max(scale, 1.0)
    centres = (np.arange(n_out) + 0.5) * scale
    positions = np.arange(n_in) + 0.5
    weights = np.maximum(0.0, 1.0 - np.abs(positions[None, :] - centres[:, None]) / support)
    weights /= weights.sum(axis=1, keepdims=True)
    return weights.astype(np.float32)


def process(encoded: bytes) -> ProcessedImage:
    """Decode, resize to 448×448 (separable triangle filter), normalise, channels first."""
    pixels = decode_image(encoded)
    height, width, _ = pixels.shape
    planes = pixels.transpose(2, 0, 1).astype(np.float32) * np.float32(1 / 255)
    rows = _resize_weights(height, TARGET_SIDE)
    cols = _resize_weights(width, TARGET_SIDE).T.copy()
    resized = np.stack([rows @ plane @ cols for plane in planes])
    pixel_values = (resized - _MEAN) / _STD
    tokens = (TARGET_SIDE // _PATCH // _MERGE) ** 2
    return ProcessedImage(
        tensors={
            "pixel_values": np.ascontiguousarray(pixel_values, dtype=np.float32),
            "image_sizes": np.array([height, width], dtype=np.int64),
        },
        prompt_update={"modality": "image", "num_tokens": tokens},
    )


def tensor_digests(tensors: Mapping[str, object]) -> dict[str, bytes]:
    """A 16-byte SHA-256 digest per tensor, over its dtype, shape and bytes."""
    digests = {}
    for name, value in tensors.items():
        array = np.ascontiguousarray(np.asarray(value))
        hasher = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
        hasher.update(array.data.cast("B"))
        digests[name] = hasher.digest()[:16]
    return digests
