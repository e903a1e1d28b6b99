"""The one exception the CLI turns into a one-line message."""


class CLIError(Exception):
    """Something the user can fix (a missing model, a busy port, no stack running); printed as one line."""
