"""What a path given by a user names on disk, with the OS's refusals to look it up (a name over
255 bytes, a NUL byte, a loop of links, no permission) as one-line tapc errors."""
from __future__ import annotations

import os
import stat

from tapc.errors import TapcError


def kind(path, what: str, error: type[TapcError] = TapcError) -> str | None:
    """"dir", "file", "other" or None (nothing there) for `path`; `error` naming `what` (e.g.
    "spec file") where the OS cannot look it up."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError) as e:   # ValueError: a NUL byte in the path
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise error(f"{what} {shown(path)}: {why}") from None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def shown(path, limit: int = 160) -> str:
    """A path as a message quotes it: whole up to `limit` characters (a deep path stays whole, to be
    copied), else its start and its length."""
    text = str(path)
    return text if len(text) <= limit else f"{text[:limit - 30]}... ({len(os.fsencode(text))} bytes)"
