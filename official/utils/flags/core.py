"""Helpers for defining flags on any FlagValues and validating them at start-up."""

from absl import flags


def require_positive(
    name: str, allow_none: bool = False, flag_values: flags.FlagValues = flags.FLAGS
) -> None:
    """Registers a validator: --`name` must be > 0 (or unset, if `allow_none`)."""
    flags.register_validator(
        name,
        lambda value: (allow_none and value is None) or (value is not None and value > 0),
        message=f"--{name} must be a positive number",
        flag_values=flag_values,
    )


def require_non_negative(
    name: str, allow_none: bool = False, flag_values: flags.FlagValues = flags.FLAGS
) -> None:
    """Registers a validator: --`name` must be >= 0 (or unset, if `allow_none`)."""
    flags.register_validator(
        name,
        lambda value: (allow_none and value is None) or (value is not None and value >= 0),
        message=f"--{name} must not be negative",
        flag_values=flag_values,
    )
