"""Data: dictionaries, subword models, memory-mapped indexed datasets, pair datasets and batching."""
