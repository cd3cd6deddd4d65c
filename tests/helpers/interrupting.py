"""A stream that gets a signal while C++ code writes to it (torch's zip writer calls its ``write``)."""

from __future__ import annotations

import io
import signal


class SignalOnWrite(io.BytesIO):
    """A stream whose third write gets ``signum``: torch's zip writer calls it from C++."""

    def __init__(self, signum: int):
        super().__init__()
        self.signum, self.writes = signum, 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes == 3:
            signal.raise_signal(self.signum)
        return super().write(data)
