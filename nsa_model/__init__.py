"""NSA model core: config, the NSA functional core (ops/), attention modules and the decoder. No Ray here."""

from nsa_model.config import ModelConfig, NSAConfig, get_preset, preset_names
from nsa_model.model import Transformer, compile_model

__all__ = ["ModelConfig", "NSAConfig", "Transformer", "compile_model", "get_preset", "preset_names"]
