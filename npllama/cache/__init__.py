"""Key/value storage: the KV cache of one sequence, the paged pool of many, and the memory they may take."""
