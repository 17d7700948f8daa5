"""
The mechanics every train_*.py shares, written once: configuration, the LR schedule.
"""
import ast
import dataclasses
import types
import typing


# -----------------------------------------------------------------------------
# configuration: dataclass defaults <- config file <- --key=value flags

class ConfigError(ValueError):
    pass


def read_config_file(path: str) -> dict:
    """Run a Python config file (plain `key = value` lines) and return the names it sets."""
    namespace: dict = {}
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), namespace)
    except (OSError, SyntaxError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    return {k: v for k, v in namespace.items()
            if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def parse_flag_value(text: str):
    """--key=value: a Python literal when it is one (3e-4, 32, True, None), else the string itself."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def check_type(key: str, value, annotation, source: str):
    allowed = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if type(value) in allowed:  # exact: a bool is not accepted as an int
        return value
    if type(value) is int and float in allowed:
        return float(value)
    names = " | ".join(getattr(t, "__name__", str(t)) for t in allowed)
    raise ConfigError(f"config key {key!r} (from {source}) must be {names}, got {value!r} ({type(value).__name__})")


def load_config(argv: list[str], *schemas):
    """Build one instance of each dataclass in schemas from `[config_file] [--key=value ...]`.
    Every key must belong to exactly one schema and match its field's type."""
    argv = list(argv or [])
    settings = []  # (key, value, source), applied in order: the file first, then the flags
    if argv and not argv[0].startswith("--"):
        path = argv.pop(0)
        settings += [(k, v, path) for k, v in read_config_file(path).items()]
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, text = arg[2:].split("=", 1)
        settings.append((key, parse_flag_value(text), "command line"))
    fields = {f.name: (schema, f.type) for schema in schemas for f in dataclasses.fields(schema)}
    values: dict = {schema: {} for schema in schemas}
    for key, value, source in settings:
        if key not in fields:
            raise ConfigError(f"unknown config key {key!r} (from {source}); known keys: {', '.join(sorted(fields))}")
        schema, annotation = fields[key]
        values[schema][key] = check_type(key, value, annotation, source)
    return tuple(schema(**values[schema]) for schema in schemas)
