"""The one exception type the CLI turns into a single error line (never a traceback)."""


class ColibriError(Exception):
    """An error the user can act on: bad file, bad flag, unsupported model."""
