"""Sampling from a trained model: a KV cache, a next-token sampler and the generation loop."""

from lm.generate.engine import generate
from lm.generate.kv_cache import KVCache
from lm.generate.sampling import sample_next_token, top_k_filter, top_p_filter
from lm.generate.seq2seq import Seq2SeqCache, beam_search, greedy_decode, translate

__all__ = [
    "KVCache",
    "Seq2SeqCache",
    "beam_search",
    "generate",
    "greedy_decode",
    "sample_next_token",
    "top_k_filter",
    "top_p_filter",
    "translate",
]
