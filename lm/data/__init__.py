"""Token data: the token file format, random batches, and a resumable training dataset.

write_token_file / read_token_file   the flat id file ``lm tokenize`` writes, with its sidecar
tokenize_file                         a text file of any size to a token file, in parallel
get_batch                             random (x, y) windows from a 1-D (memory-mapped) array
TokenDataset                          a checked token file with a seeded, checkpointable sampler
read_parallel / tokenize_pairs / write_pair_file / read_pair_file / PairDataset / PairBatch
                                      parallel text for translation (lm.data.pairs)
"""

import importlib
from typing import TYPE_CHECKING

# Each name is imported from its module when first used, so that the token-file and tokenize
# modules (and `lm tokenize`, `lm tokenizer ...`, `lm --help`) start without importing torch.
_MODULES = {
    "get_batch": "batch",
    "TokenDataset": "dataset",
    "PairBatch": "pairs",
    "PairDataset": "pairs",
    "read_pair_file": "pairs",
    "read_parallel": "pairs",
    "tokenize_pairs": "pairs",
    "write_pair_file": "pairs",
    "read_token_file": "token_file",
    "read_token_meta": "token_file",
    "write_token_file": "token_file",
    "tokenize_file": "tokenize",
}

if TYPE_CHECKING:
    from lm.data.batch import get_batch
    from lm.data.dataset import TokenDataset
    from lm.data.pairs import PairBatch, PairDataset, read_pair_file, read_parallel, tokenize_pairs, write_pair_file
    from lm.data.token_file import read_token_file, read_token_meta, write_token_file
    from lm.data.tokenize import tokenize_file


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lm.data.{_MODULES[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "PairBatch",
    "PairDataset",
    "TokenDataset",
    "get_batch",
    "read_pair_file",
    "read_parallel",
    "read_token_file",
    "read_token_meta",
    "tokenize_file",
    "tokenize_pairs",
    "write_pair_file",
    "write_token_file",
]
