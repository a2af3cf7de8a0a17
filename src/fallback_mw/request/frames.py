"""An error leaving the gateway for its host keeps its traceback but not the local
variables of the gateway's own frames.

A host's error reporter records the locals of every frame an error went through (Sentry's
`include_local_variables`, on by default; rich's and pytest's `show_locals`): the
gateway's frames hold the request's body, the caller's query and the provider credential
it injected (an attempt's `credential`, the headers it sent). Only the gateway's frames are
cleared: the host's own keep theirs for its report."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Final

from fallback_mw.error_chain import error_chain

# The package's directory: a frame whose code lives below it is the gateway's.
_PACKAGE: Final = str(Path(__file__).resolve().parents[1])


def drop_gateway_locals(error: BaseException, *, every_frame: bool = False) -> None:
    """Clear the locals of the gateway's finished frames in `error`'s traceback and in
    those of the errors it was raised from or during (file, line and function stay).
    `every_frame`: the host's frames too (the Django adapter's, whose frames between it
    and the error hold the request's scope)."""
    for current in error_chain(error):
        tb = current.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if every_frame or frame.f_code.co_filename.startswith(_PACKAGE):
                # One still running (the frame catching it) is left: no report has it yet.
                with contextlib.suppress(RuntimeError):
                    frame.clear()
            tb = tb.tb_next
