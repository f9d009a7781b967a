"""Byte-level BPE: training (:func:`train_bpe`) and encoding/decoding (:class:`Tokenizer`)."""

from lm.tokenizer.files import check_tokenizer_checksum, load_tokenizer_dir, save_tokenizer_dir
from lm.tokenizer.tokenizer import EOT, Tokenizer
from lm.tokenizer.train import train_bpe

__all__ = ["EOT", "Tokenizer", "train_bpe", "load_tokenizer_dir", "save_tokenizer_dir", "check_tokenizer_checksum"]
