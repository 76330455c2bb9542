"""cachefs: a distributed cache filesystem for AI training data."""

__version__ = "0.1.0"
