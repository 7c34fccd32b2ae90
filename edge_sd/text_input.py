"""Text coming in (prompts, prompt files, chat lines, the API's text): UTF-8, or one error that names
the input and where its bytes go wrong. Bytes that are not UTF-8 are refused rather than replaced: a
prompt silently changed would give another output than the user asked for."""

from __future__ import annotations

from edge_sd.errors import UsageError


def decode(data: bytes, what: str) -> str:
    """`data` as text; UsageError naming `what` (e.g. "the prompt file p.txt") where it is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{what} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start}") from None


def check(text: str, what: str) -> str:
    """`text` if it is text; else the text its escaped bytes spell where they are UTF-8 after all (a
    command line decoded under another locale); else UsageError naming `what`. Python hands on the
    bytes a command line or a terminal could not decode as lone surrogates."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        raw = text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate no decoding escaped
        raise UsageError(f"{what} is not UTF-8 text: it holds a lone surrogate") from None
    return decode(raw, what)
