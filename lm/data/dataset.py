"""A checked token file with a resumable, rank-aware batch sampler."""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lm.checks import check_flag, check_rank, check_seed, check_size, is_count
from lm.data.batch import check_numpy_generator, check_starts, windows_to_xy
from lm.data.token_file import bytes_per_token, max_token_id, read_token_file


class TokenDataset:
    """A token file opened for training: validated once, then sampled without loading it.

    Every rank draws the same *global* batch of ``batch_size * world_size`` start positions from
    one generator seeded with ``seed`` and keeps its own slice. So ranks see different windows,
    the generator state is identical on every rank (rank 0's checkpoint resumes them all), and
    ``N`` processes with batch ``B`` see exactly the data of one process with batch ``N * B``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        context_length: int,
        *,
        vocab_size: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        check_ids: bool = True,
    ):
        check_size("context_length", context_length)
        check_size("world_size", world_size)
        if vocab_size is not None:
            check_size("vocab_size", vocab_size)  # '100' had failed with "'>' not supported", 0 as a smaller vocabulary
        check_flag("check_ids", check_ids)  # a string is truthy: check_ids="no" had checked
        check_rank(rank, world_size)
        self.path = Path(path)
        self.tokens, self.meta = read_token_file(path)
        self.context_length = context_length
        self.rank, self.world_size = rank, world_size
        n = len(self.tokens)
        if n <= context_length:
            raise ValueError(f"{str(self.path)!r} has {n} tokens, fewer than context_length + 1 = {context_length + 1}")
        if vocab_size is not None:
            if self.meta["vocab_size"] > vocab_size:
                raise ValueError(
                    f"{str(self.path)!r} was tokenized with vocab_size {self.meta['vocab_size']}, "
                    f"larger than the model's vocab_size {vocab_size}"
                )
            if check_ids:
                top = max_token_id(self.path, self.tokens.dtype)
                if top >= vocab_size:
                    raise ValueError(
                        f"{str(self.path)!r} contains token id {top}, outside the model's vocabulary [0, {vocab_size})"
                    )
        self.generator = np.random.Generator(np.random.PCG64(check_seed(seed, "seed")))
        # Windows are read with pread, not through the memmap: on kernels that map whole large
        # page-cache folios (up to 2 MB) on a fault, each random window through a memmap adds
        # megabytes of resident memory, so a long run would map most of the file.
        self._file = open(self.path, "rb", buffering=0)  # noqa: SIM115 (lives as long as the dataset)
        weakref.finalize(self, self._file.close)  # closed when the dataset goes (it had been a ResourceWarning)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def bytes_per_token(self) -> float | None:
        """Source bytes per token, from the sidecar; None when the sidecar does not say."""
        return bytes_per_token(self.meta)

    @property
    def tokenizer_sha256(self) -> str:
        return self.meta.get("tokenizer_sha256", "")

    def global_starts(self, batch_size: int, generator: np.random.Generator | None = None) -> np.ndarray:
        """Start positions of one global batch (every rank's rows) from ``generator``."""
        check_size("batch_size", batch_size)
        check_numpy_generator(generator)
        gen = self.generator if generator is None else generator
        high = len(self.tokens) - self.context_length
        return gen.integers(0, high, size=batch_size * self.world_size)

    def sample(self, batch_size: int, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``batch_size`` rows of the next global batch, as ``(x, y)`` on ``device``."""
        starts = self.global_starts(batch_size)
        mine = starts[self.rank * batch_size : (self.rank + 1) * batch_size]
        return self.batch(mine, device)

    def fixed_batches(self, num_batches: int, batch_size: int, seed: int) -> list[np.ndarray]:
        """This rank's starts for ``num_batches`` batches that are the same at every call (evaluation)."""
        if not is_count(num_batches):  # -1 had given [] and 1.5 a TypeError from range()
            raise ValueError(f"num_batches must be a non-negative integer, got num_batches={num_batches!r}")
        gen = np.random.Generator(np.random.PCG64(check_seed(seed, "seed")))
        out = []
        for _ in range(num_batches):
            starts = self.global_starts(batch_size, gen)
            out.append(starts[self.rank * batch_size : (self.rank + 1) * batch_size])
        return out

    def batch(self, starts: np.ndarray, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` for the windows beginning at ``starts``."""
        return windows_to_xy(self.windows(starts), device)

    def windows(self, starts: np.ndarray) -> np.ndarray:
        """The ``context_length + 1`` ids from each start, shape ``(len(starts), context_length + 1)``.

        Every start is an integer in ``[0, len(self) - context_length - 1]`` (the last start whose
        window and target fit), as in :func:`lm.data.batch.batch_at`; else a one-line ValueError.
        """
        starts = check_starts(starts, len(self.tokens), self.context_length)
        width = self.context_length + 1
        itemsize = self.tokens.dtype.itemsize
        out = np.empty((len(starts), width), dtype=self.tokens.dtype)
        if not hasattr(os, "preadv"):  # Windows: fall back to the memmap
            for i, s in enumerate(starts):
                out[i] = self.tokens[s : s + width]
            return out
        fd = self._file.fileno()
        for i, s in enumerate(starts):
            if os.preadv(fd, [out[i]], int(s) * itemsize) != width * itemsize:
                raise OSError(f"short read from {str(self.path)!r}: was the file changed during training?")
        return out

    def state_dict(self) -> dict[str, Any]:
        """The sampler's position: the numpy bit-generator state (plain ints, safe to checkpoint)."""
        return {"generator": self.generator.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; anything else is a one-line ValueError, the generator unchanged."""
        if not isinstance(state, dict) or "generator" not in state:
            got = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else repr(state)
            raise ValueError(f"state must be a TokenDataset.state_dict() (a dict with 'generator'), got {got}")
        try:
            self.generator.bit_generator.state = state["generator"]
        except (TypeError, ValueError, KeyError, OverflowError) as e:
            text = f"no key {e}" if isinstance(e, KeyError) else str(e).strip().splitlines()[0]
            raise ValueError(f"state: 'generator' is not a PCG64 generator state ({text})") from None
