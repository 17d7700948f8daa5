"""
A user's mistake -- a config key, a data file, a tokenizer, a checkpoint, a run that diverges -- is one line
`error: ...` and exit status 2; a traceback means a bug. Every kind of mistake is a UserError, raised where it is
found with a message that names the key, file, line or field; check_ranges does it for a key outside its range.
"""
import math
import os
import sys


class UserError(Exception):
    """Something the user gave cannot work."""


class ConfigError(UserError, ValueError):
    """A config key that is unknown, of the wrong type or out of range."""


class DataError(UserError, ValueError):
    """A data file that cannot train: missing, malformed, or too small for the batch asked for."""


class BadRecord(DataError):
    """One malformed record; whoever reads the file adds its file:line."""


class TokenizerError(UserError, ValueError):
    """A tokenizer file that cannot be loaded, or not the one a checkpoint was trained with."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be read, or does not fit the model or run it is loaded into."""


class RewardError(UserError, RuntimeError):
    """A reward function that raised or returned something other than a finite number, on a named record."""


class NonFiniteError(UserError, RuntimeError):
    """A run that diverged: too many non-finite steps in a row, or non-finite weights to save."""


class DiskFullError(UserError, OSError):
    """No space left (or over quota) where a file was being written; nothing already written was replaced."""


class OutOfMemoryError(UserError, MemoryError):
    """The device ran out of memory during training; said by the rank it happened on (memory.out_of_memory)."""


# -----------------------------------------------------------------------------
# a key's valid values: (test of a value, the rule as an error says it), for config.RANGES and model.MODEL_RANGES

AT_LEAST_1 = (lambda v: v >= 1, "at least 1")
ABOVE_0 = (lambda v: v > 0, "above 0")
NOT_NEGATIVE = (lambda v: v >= 0, "0 or more")
FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")  # probabilities (dropout), momenta, shares of a run


def check_ranges(config, rules: dict):
    """The first key of config (a dataclass) outside its rule as a ConfigError naming the key, the rule and the
    value. None always passes (an Optional key not set); a float must also be finite: a config file may say
    `lr = float("nan")`."""
    for key, (ok, rule) in rules.items():
        value = getattr(config, key)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key {key!r} must be a finite number, {rule}, got {value!r}")
        if value is not None and not ok(value):
            raise ConfigError(f"config key {key!r} must be {rule}, got {value!r}")


def cli(main):
    """The entry point of a script: main(sys.argv[1:]), a UserError (or a missing file) as one line, exit 2."""
    try:
        main(sys.argv[1:])
    except (UserError, FileNotFoundError) as e:
        # under torchrun every rank fails alike, and rank 0 says it; memory runs out on one rank, which says it
        if int(os.environ.get("RANK", 0)) == 0 or isinstance(e, OutOfMemoryError):
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
