"""Computing logits from token ids: the transformer, its layer loop, the fused decode step,
sessions and batched passes."""
