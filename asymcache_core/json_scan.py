"""Where a JSON value ends in a text that may go on after it (a tool call's arguments inside
the call's markup, a reply still being generated): string-aware bracket depth, read once as
the text grows (:class:`ObjectScan`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ObjectScan:
    """A JSON value's end, found by reading its text once, as it grows: string-aware bracket
    depth, resumed where the last read stopped (a stream reads each of its texts' new part).

    Attributes:
        pos: the next index to read (starts at the value's ``{`` or ``[``).
        depth: brackets open.
        in_string: inside a string.
        escaped: after a backslash in a string.
    """

    pos: int
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def end(self, text: str, stop: int | None = None) -> int | None:
        """Read ``text`` on from :attr:`pos` (the same text, grown), up to ``stop``.

        Args:
            text: the text.
            stop: read no further than this index (None: its end).

        Returns:
            The index just past the value's closing bracket, or None while it is not closed.
        """
        stop = len(text) if stop is None else stop
        for i in range(self.pos, stop):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = max(self.pos, stop)
        return None


def arguments_span(text: str, start: int) -> int | None:
    """Where the JSON object starting at ``text[start]`` ends.

    Args:
        text: the text.
        start: the index of the object's ``{``.

    Returns:
        The index just past its closing brace, or None while it is not closed.
    """
    return ObjectScan(start).end(text)


__all__ = ["ObjectScan", "arguments_span"]
