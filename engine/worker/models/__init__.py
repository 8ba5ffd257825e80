"""Model implementations. GPT-2 is the only architecture served."""
from engine.worker.models.gpt2 import GPT2, GPT2Config, find_checkpoint, load_gpt2

__all__ = ["GPT2", "GPT2Config", "find_checkpoint", "load_gpt2"]
