"""Importing this module registers every built-in component (each module's decorators run on import)."""

# Keep this list in sync with the modules that call attnmt.registry.register / register_arch.
import attnmt.criterions  # noqa: F401
import attnmt.data.subword  # noqa: F401
import attnmt.generation.beam  # noqa: F401
import attnmt.generation.constrained  # noqa: F401
import attnmt.generation.sampling  # noqa: F401
import attnmt.models.architectures  # noqa: F401
import attnmt.models.transformer  # noqa: F401
import attnmt.optim  # noqa: F401
import attnmt.registry  # noqa: F401
import attnmt.tasks.translation  # noqa: F401
