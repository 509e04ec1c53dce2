"""GGUF files: reading and checking them, and where they come from."""
