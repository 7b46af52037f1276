"""Exceptions for bad input, so the CLI can print one readable line instead of a traceback."""


class LMForgeError(Exception):
    """Bad input (config, data, checkpoint, request). The message names what is wrong."""


class ConfigError(LMForgeError, ValueError):
    """An invalid or inconsistent configuration value."""


class DataError(LMForgeError, ValueError):
    """A missing, empty or malformed data file."""


class CheckpointError(LMForgeError, ValueError):
    """A missing, corrupt or mismatched checkpoint."""


def require_positive_ints(obj: object, *names: str) -> None:
    """Raise ConfigError naming the first of `names` that is not an integer >= 1 on `obj`
    (a config dataclass); booleans do not count as integers."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
