"""lm: a decoder-only Transformer language-model toolkit written from scratch.

Stages of the pipeline, one package each:
    lm.tokenizer  text -> token ids (byte-level BPE)
    lm.nn         hand-written layers (einops)
    lm.model      the Transformer LM
    lm.generate   sampling with a KV cache
"""

__version__ = "0.1.0"
