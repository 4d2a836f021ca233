"""A JVM error in the operator's logs: what py4j raises carries the whole Java stack trace
in its text, so a warning about a step that falls back (a plan not kept, a batch not
declared one partition, no executor placement) names only its first line."""

from __future__ import annotations


def first_line(e: BaseException) -> str:
    """The first line of ``e``'s text (a Java exception's class and message), or its repr
    when it has no text."""
    text = str(e).strip()
    return text.splitlines()[0] if text else repr(e)
