"""Weight and tokenizer loaders: Hugging Face directories, GGUF files and model aliases."""

from ssd.workers.loader.load import ALIASES, LoadedModel, ModelNotFoundError, load_model, resolve_alias
from ssd.workers.loader.tokenizer import Tokenizer

__all__ = ["ALIASES", "LoadedModel", "ModelNotFoundError", "Tokenizer", "load_model", "resolve_alias"]
