"""Output that outlives its reader: ``um-lab run ... | head -1`` closes stdout (and ``2>&1`` stderr too) while the
work goes on; what is written after that goes to the null device, with no error."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def silence(stream: Any) -> None:
    """Point ``stream``'s file descriptor at the null device: its reader went away (``| head``); what is written
    to it from now on goes nowhere, with no error now nor when Python flushes it at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stream without a file descriptor (captured)
        pass


class QuietBar:
    """A tqdm progress bar on stderr (``tqdm_options``: ``total``, ``unit``, ``desc``, ``disable``) that goes on
    drawing to the null device once stderr's reader went away: the work is not stopped by its progress bar."""

    def __init__(self, **tqdm_options: Any) -> None:
        from tqdm.auto import tqdm

        self._bar = self._call(lambda: tqdm(**tqdm_options))

    @staticmethod
    def _call(draw: Callable[[], Any]) -> Any:
        try:
            return draw()
        except BrokenPipeError:
            silence(sys.stderr)
            return draw()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more done."""
        self._call(lambda: self._bar.update(n))

    def set_postfix_str(self, text: str) -> None:
        """Show ``text`` after the bar."""
        self._call(lambda: self._bar.set_postfix_str(text))

    def close(self) -> None:
        """Draw the bar a last time and let go of stderr."""
        self._call(self._bar.close)
