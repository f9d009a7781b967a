"""lm: a Transformer language-model toolkit written from scratch, from bytes to a served model.

One idea per package; the public names of each are in docs/api.md:

    lm.tokenizer   byte-level BPE: train, encode, decode; GPT-2 and Hugging Face file formats
    lm.nn          hand-written layers in einops (Linear, Embedding, RMSNorm, SwiGLU, RoPE,
                   attention, blocks), softmax and the fused cross-entropy
    lm.model       the decoder-only TransformerLM and the encoder–decoder of "Attention Is All
                   You Need", their configs, build_model
    lm.optim       AdamW, parameter groups, learning-rate schedules, gradient clipping
    lm.data        token files, random batches, resumable datasets, parallel text for translation
    lm.train       the TOML-configured training loop: evaluation, checkpoints, exact resume, DDP
    lm.checkpoint  atomic checkpoints, the last K and best of a run, safetensors export
    lm.evaluate    loss, perplexity and bits per byte of a model on a text or token file
    lm.generate    loading a model once, sampling with a KV cache, the compiled decode step,
                   greedy and beam-search translation, text streaming
    lm.serve       the OpenAI-compatible server: continuous-batching engine, HTTP app, playground
    lm.export      Hugging Face transformers (Llama) export
    lm.demo        the whole pipeline in minutes on synthetic or real stories
    lm.cli         the `lm` command line (`lm --help`)
    lm.io, lm.device   outputs that are never half-written or overwritten; device and dtype choice
"""

__version__ = "0.1.0"
