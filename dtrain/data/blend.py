"""Weighted blends of indexed datasets, Megatron-LM's ``BlendedDataset`` and ``--data-path``.

A blend such as ``"0.3 /data/web_text_document 0.7 /data/code_text_document"`` draws each sample
from one dataset chosen greedily: sample ``n`` comes from the dataset furthest behind its share,
``argmax_i(weight_i * max(n, 1) - count_i)`` with the first dataset winning ties
(``build_blending_indices`` in Megatron's helpers.cpp). So after every ``n`` samples each
dataset's count is within one of ``weight * n``, and the same weights and size give Megatron's
order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dtrain.config import ConfigError
from dtrain.data.indexed import GPTSampleDataset, IndexedDataset, split_ranges
from dtrain.data.window import WindowDataset

SPLITS = ("train", "valid", "test")
SURPLUS = 0.005
"""Extra share of samples each blended dataset builds beyond its target (Megatron's
``mid_level_dataset_surplus``)."""


def parse_blend(blend: str | Sequence[str] | Sequence[tuple[float, str]]
                ) -> list[tuple[float, str]]:
    """(weight, prefix) pairs with weights normalised to sum 1, from Megatron's ``--data-path``
    form (``"0.3 prefixA 0.7 prefixB"``, or that string split into a list), from
    ``[(0.3, "prefixA"), (0.7, "prefixB")]``, or from one prefix alone (weight 1)."""
    items: list = blend.split() if isinstance(blend, str) else list(blend)
    if items and all(isinstance(item, tuple | list) for item in items):
        pairs = [tuple(item) for item in items]
    elif len(items) == 1:
        pairs = [(1.0, items[0])]
    elif len(items) % 2 == 0:
        pairs = list(zip(items[0::2], items[1::2], strict=True))
    else:
        pairs = []
    try:
        weighted = [(float(weight), str(prefix)) for weight, prefix in pairs]
    except (TypeError, ValueError):
        weighted = []
    if not weighted or min(w for w, _ in weighted) < 0 or sum(w for w, _ in weighted) <= 0:
        raise ConfigError(f"blend {blend!r} must be 'weight prefix weight prefix ...' with "
                          "non-negative weights (e.g. '0.3 data/a_text_document 0.7 "
                          "data/b_text_document'), or a single prefix")
    total = float(np.sum(np.array([w for w, _ in weighted], dtype=np.float64)))
    return [(w / total, prefix) for w, prefix in weighted]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` samples, which dataset it comes from (int16) and the how-manieth sample
    of that dataset it is (int64), by Megatron's greedy rule (module docstring). ``weights`` must
    sum to 1. Each choice depends on the counts before it, so this is one sequential pass in
    Python floats (float64, as helpers.cpp; docs/benchmarks.md has its speed),
    filled into numpy a block at a time to keep memory at the two output arrays."""
    weights = [float(w) for w in weights]
    counts = [0] * len(weights)
    which, nth = np.empty(size, dtype=np.int16), np.empty(size, dtype=np.int64)
    others = range(1, len(weights))
    for start in range(0, size, 1 << 16):
        chosen, taken = [], []
        for n in range(start, min(start + (1 << 16), size)):
            scale = float(max(n, 1))
            best, best_error = 0, weights[0] * scale - counts[0]
            for i in others:
                error = weights[i] * scale - counts[i]
                if error > best_error:
                    best, best_error = i, error
            chosen.append(best)
            taken.append(counts[best])
            counts[best] += 1
        which[start:start + len(chosen)], nth[start:start + len(taken)] = chosen, taken
    return which, nth


class BlendedDataset:
    """``size`` samples drawn from several datasets in the proportions ``weights`` (normalised),
    in Megatron's order. ``window(i)`` is the ``dataset_sample_index[i]``-th window of dataset
    ``dataset_index[i]``. Each dataset must hold the windows the blend takes from it."""

    def __init__(self, datasets: Sequence[WindowDataset], weights: Sequence[float], size: int):
        if len(datasets) != len(weights) or not 0 < len(datasets) < 32767:
            raise ConfigError(f"a blend needs one weight per dataset (1 to 32766 datasets), got "
                              f"{len(datasets)} datasets and {len(weights)} weights")
        if min(weights) < 0 or sum(weights) <= 0:
            raise ConfigError(f"blend weights {list(weights)} must be non-negative with a "
                              "positive sum")
        array = np.array(weights, dtype=np.float64)
        self.datasets, self.size = list(datasets), size
        self.weights = (array / array.sum()).tolist()
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, size)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for i, (dataset, needed) in enumerate(zip(self.datasets, counts, strict=True)):
            if needed > len(dataset):
                raise ConfigError(f"blend dataset {i} holds {len(dataset)} samples, the blend "
                                  f"takes {needed}: build it with num_samples >= {needed}")

    def __len__(self) -> int:
        return self.size

    def window(self, index: int) -> np.ndarray:
        """Sample ``index`` of the blend: ``seq_len + 1`` tokens."""
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range for {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[index])]
        return dataset.window(int(self.dataset_sample_index[index]))


def build_gpt_dataset(blend: str | Sequence, seq_len: int, num_samples: int,
                      split: str = "969,30,1", split_name: str = "train", seed: int = 1234,
                      cache_dir: str | Path | None = None,
                      opened: list[tuple[float, IndexedDataset]] | None = None
                      ) -> GPTSampleDataset | BlendedDataset:
    """The ``split_name`` part (train, valid or test) of one prefix or a weighted blend, as
    windows of ``seq_len + 1`` tokens, like Megatron's ``--data-path BLEND --split SPLIT``: each
    dataset is split by ``split``; a single prefix gives at least ``num_samples`` samples, a blend
    gives ``sum_i ceil(num_samples * weight_i)`` samples, each dataset building its share plus
    ``SURPLUS``. ``opened``: the blend's datasets opened already (``open_blend``)."""
    if split_name not in SPLITS:
        raise ConfigError(f"split_name '{split_name}' must be one of {', '.join(SPLITS)}")
    pairs = opened if opened is not None else open_blend(blend)
    part = SPLITS.index(split_name)

    def samples(dataset: IndexedDataset, count: int) -> GPTSampleDataset:
        documents = split_ranges(split, len(dataset))[part]
        return GPTSampleDataset(dataset, documents, seq_len, count, seed, cache_dir)

    if len(pairs) == 1:
        return samples(pairs[0][1], num_samples)
    targets = [math.ceil(num_samples * weight) for weight, _ in pairs]
    datasets = [samples(dataset, math.ceil(target * (1 + SURPLUS)))
                for target, (_, dataset) in zip(targets, pairs, strict=True)]
    return BlendedDataset(datasets, [weight for weight, _ in pairs], sum(targets))


def open_blend(blend: str | Sequence) -> list[tuple[float, IndexedDataset]]:
    """(normalised weight, dataset) for each prefix of ``blend`` (``parse_blend``'s forms), each
    opened and its index checked (``IndexedDataset``); the samples are not built. Raises
    ConfigError naming the first missing or damaged file."""
    return [(weight, IndexedDataset(prefix)) for weight, prefix in parse_blend(blend)]
