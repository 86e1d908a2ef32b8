"""Models and their named architectures; importing the package registers the built-in ones."""

from attnmt.models import architectures, transformer  # noqa: F401  (their decorators register them)
