"""The CLI's user-error type, in its own module so `python -m deepinfer.cli.main` and the
`deepinfer` script raise and catch the same class."""


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""
