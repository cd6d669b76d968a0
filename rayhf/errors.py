"""The one exception type for mistakes a user can fix (config, files, values).

The CLI prints ``RayhfError`` as one line and exits 2; everything else is a bug and keeps its
traceback.
"""


class RayhfError(ValueError):
    """A user error whose message names what to change: a config field, a file or a value."""
