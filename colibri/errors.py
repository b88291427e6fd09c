"""The exception types the CLI turns into a single error line (never a traceback)."""


class ColibriError(Exception):
    """An error the user can act on: bad file, bad flag, unsupported model. Exit status 1."""

    exit_status = 1


class ConfigError(ColibriError):
    """The configuration cannot work (a state directory that is a file, a model path that is not
    one, an engine that fails to start the same way twice): nothing is started, or what started
    stops. Exit status 2, as for a usage error: retrying the same command cannot help."""

    exit_status = 2
