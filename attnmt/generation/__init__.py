"""Generation: beam search, greedy, sampling, and the batched generator; importing the package registers the
built-in search strategies."""

from attnmt.generation import beam, constrained, sampling  # noqa: F401  (their decorators register them)
