"""The offline default corpus for ``lm demo``: synthetic children's stories made by a seeded generator.

The text is synthetic (procedurally generated, not written by people); it stands in for TinyStories
when no real data is on the machine. See ``lm.demo.stories`` (``generate_story``, ``write_corpus``).
"""
