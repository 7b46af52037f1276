"""Exceptions for bad input, so the CLI can print one readable line instead of a traceback."""


class LMForgeError(Exception):
    """Bad input (config, data, checkpoint, request). The message names what is wrong."""


class ConfigError(LMForgeError, ValueError):
    """An invalid or inconsistent configuration value."""


class DataError(LMForgeError, ValueError):
    """A missing, empty or malformed data file."""


class CheckpointError(LMForgeError, ValueError):
    """A missing, corrupt or mismatched checkpoint."""
