"""How an error message quotes a value the user gave: its repr, cut to a bounded length."""
from __future__ import annotations


def shown(value, limit: int = 60) -> str:
    """repr of `value`, cut to `limit` characters (a 5,000-digit number or a huge list stays one line)."""
    try:
        text = repr(value)
    except ValueError:   # an int of more digits than Python converts to text
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= limit else f"{text[:limit - 20]}... ({len(text)} characters)"
