"""kiln's version: recorded in every engine header and timing-cache key."""

__version__ = "0.1.0"
