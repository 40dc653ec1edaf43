"""Conversion progress on stderr: one updating line on a terminal, a line every few seconds otherwise."""
from __future__ import annotations

import sys
import time


def human_bytes(n: float) -> str:
    """1234567 -> '1.2 MB' (decimal units, as disk sizes are quoted)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    def __init__(self, label: str, enabled: bool = True, stream=None, tty_interval_s: float = 0.1,
                 log_interval_s: float = 5.0):
        self.label, self.enabled = label, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval_s = tty_interval_s if self.tty else log_interval_s
        self.total = self.done = 0
        self.t0 = self.last = 0.0

    def start(self, total_bytes: int) -> None:
        self.total, self.done = total_bytes, 0
        self.t0 = self.last = time.monotonic()

    def advance(self, nbytes: int, what: str = "") -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self.last >= self.interval_s:
            self.last = now
            self._emit(what)

    def finish(self) -> None:
        if self.enabled:
            self._emit("done", final=True)

    def note(self, lines: list[str]) -> None:
        """Choices the converter made that the user should know about (type fallbacks)."""
        if self.enabled:
            for line in lines:
                self.stream.write(("\r\x1b[2K" if self.tty else "") + f"note: {line}\n")
            self.stream.flush()

    def _emit(self, what: str, final: bool = False) -> None:
        elapsed = max(time.monotonic() - self.t0, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        line = (f"{self.label}: {pct:5.1f}% {human_bytes(self.done)}/{human_bytes(self.total)} "
                f"{human_bytes(self.done / elapsed)}/s {what}")
        if self.tty:
            self.stream.write("\r\x1b[2K" + line[:200] + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
