"""From logits to text: sampling, the generation loop, continuous batching, beam search and the text API."""
