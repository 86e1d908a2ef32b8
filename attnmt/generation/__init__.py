"""Generation: beam search, greedy, sampling, and the batched generator."""
