"""Export trained models to other ecosystems."""

from lm.export.hf import export_hf, llama_config, to_llama_state_dict, to_transformers

__all__ = ["export_hf", "llama_config", "to_llama_state_dict", "to_transformers"]
