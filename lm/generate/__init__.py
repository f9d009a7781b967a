"""Inference: loading a trained model and its tokenizer once, the generation loops (a KV cache,
a next-token sampler; greedy and beam search for translation) and text streaming."""

from lm.generate.engine import generate
from lm.generate.kv_cache import KVCache
from lm.generate.load import Loaded, load_model_and_tokenizer
from lm.generate.sampling import NonFiniteLogitsError, sample_next_token, top_k_filter, top_p_filter
from lm.generate.seq2seq import (
    Hypothesis,
    Seq2SeqCache,
    beam_search,
    beam_search_nbest,
    greedy_decode,
    line_break_ids,
    translate,
)
from lm.generate.static import DecodeStep, StaticKVCache, StaticSeq2SeqCache
from lm.generate.text import TextStreamer

__all__ = [
    "DecodeStep",
    "Hypothesis",
    "KVCache",
    "Loaded",
    "NonFiniteLogitsError",
    "Seq2SeqCache",
    "StaticKVCache",
    "StaticSeq2SeqCache",
    "TextStreamer",
    "beam_search",
    "beam_search_nbest",
    "generate",
    "greedy_decode",
    "line_break_ids",
    "load_model_and_tokenizer",
    "sample_next_token",
    "top_k_filter",
    "top_p_filter",
    "translate",
]
