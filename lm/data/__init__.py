"""Token data: the token file format, random batches, and a resumable training dataset.

write_token_file / read_token_file   the flat id file ``lm tokenize`` writes, with its sidecar
tokenize_file                         a text file of any size to a token file, in parallel
get_batch                             random (x, y) windows from a 1-D (memory-mapped) array
TokenDataset                          a checked token file with a seeded, checkpointable sampler
read_parallel / write_pair_file / read_pair_file / PairDataset / PairBatch
                                      parallel text for translation (lm.data.pairs)
"""

from lm.data.batch import get_batch
from lm.data.dataset import TokenDataset
from lm.data.pairs import PairBatch, PairDataset, read_pair_file, read_parallel, write_pair_file
from lm.data.token_file import read_token_file, read_token_meta, write_token_file
from lm.data.tokenize import tokenize_file

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
    "write_pair_file",
    "write_token_file",
]
