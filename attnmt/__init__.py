"""attnmt: the Transformer of "Attention Is All You Need", as a command-line NMT toolkit."""

__version__ = "0.1.0"
