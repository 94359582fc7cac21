"""The errors a client of engines raises to the front, and how a process's end is worded.
Low in the layers so that clients, workers and the HTTP front all share them."""
from __future__ import annotations

import signal


class EngineDeadError(RuntimeError):
    """The engine process died; no request can be served."""


class RequestFailedError(RuntimeError):
    """A step failed while running this request; the engine dropped it and kept serving.
    `engine_fault`: the fault was not this request's (every request in flight failed)."""

    def __init__(self, message: str, engine_fault: bool = False) -> None:
        super().__init__(message)
        self.engine_fault = engine_fault


def exit_message(exitcode: int | None) -> str:
    """How a process ended, from its exit code: "was killed by SIGKILL", "exited with code 1"
    (also the EP rank handles' wording)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"
