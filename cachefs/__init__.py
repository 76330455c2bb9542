"""cachefs: a distributed cache filesystem for AI training data."""

__version__ = "0.1.0"
DISTRIBUTION = "cachefs-ai"  # the name on PyPI ("cachefs" there is an unrelated project)
