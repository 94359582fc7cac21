"""The error a bad request value raises, naming its field. A leaf module: sampling parameters,
structured-output parameters and the API's request checks all raise it."""
from __future__ import annotations


class InvalidParameter(ValueError):
    """A bad request value; `param` names the field (a SamplingParams field name, which the
    API reports as the error's `param`), whatever the message says."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # picklable with its field (it may cross a process boundary)
        return type(self), (self.param, str(self))
