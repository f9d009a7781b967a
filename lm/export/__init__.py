"""Export trained models to other ecosystems."""

from lm.export.hf import export_hf, to_llama_state_dict

__all__ = ["export_hf", "to_llama_state_dict"]
