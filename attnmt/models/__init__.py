"""Models and their named architectures."""
