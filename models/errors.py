"""Errors raised while loading a model; messages are meant for the person who passed the file."""


class CheckpointError(ValueError):
    """The checkpoint cannot be read: missing, not an archive, truncated, inconsistent."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is readable but uses an architecture or option batchasr does not implement."""
