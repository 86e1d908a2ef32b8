"""``python -m attnmt.cli ...`` (what torchrun launches)."""

from attnmt.cli import main

main()
