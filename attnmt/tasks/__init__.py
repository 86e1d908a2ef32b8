"""Tasks: what loads the data and builds the model and criterion for a kind of problem; importing the package
registers the built-in ones."""

from attnmt.tasks import translation  # noqa: F401  (its decorator registers it)
