"""Text and token ids: the tokenizer built from GGUF metadata, and chat templates."""
