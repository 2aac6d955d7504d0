"""The stand-in's reading of a SageMaker model `pattern`: Java's `String.matches`, in Python.

SageMaker is a Java service: a model pattern is a `java.util.regex` expression applied to the
whole value. This is the stand-in's own translation, written apart from the launcher's
(`diloco_sagemaker.javaregex`, which `plan` uses) so that a mistake there cannot make the
stand-in accept what SageMaker refuses. It reads only what Java and Python read differently in
the patterns of the operations the stand-in serves, each as Java defines it:

- `\\d`, `\\w`, `\\s`, `\\b` are US-ASCII in Java (compiled here with `re.ASCII`);
- `.` excludes every Java line terminator (`\\n`, `\\r`, U+0085, U+2028, U+2029), not only `\\n`;
- `\\p{Alnum}`, `\\p{Alpha}`… (POSIX classes) are US-ASCII sets;
- `\\p{L}`, `\\p{Nd}`… (Unicode general categories) are the code points of that category in
  Python's `unicodedata` (a Unicode release or two from the service's JDK at most);
- a quantified anchor (`${1,128}`) is the anchor, matched once.

Anything else that differs (`\\z`, `\\Z`, `\\h`, `\\Q…\\E`, surrogate pairs, nested classes) is
refused with `Unreadable` rather than guessed: `tests/test_standin_independent.py` holds every
pattern of the served operations to being readable.
"""

from __future__ import annotations

import functools
import re
import string
import sys
import unicodedata

_POSIX = {"Lower": string.ascii_lowercase, "Upper": string.ascii_uppercase, "Alpha": string.ascii_letters,
          "Digit": string.digits, "Alnum": string.ascii_letters + string.digits, "Punct": string.punctuation,
          "XDigit": string.hexdigits, "Space": string.whitespace, "Blank": " \t"}
_LINE_TERMINATORS = "\n\r\x85\u2028\u2029"
_TOKEN = re.compile(r"\\([pP])\{(\w+)\}|\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\\[zZhQ]|\\.|\[|\]"
                    r"|[$^](?:\{\d+(?:,\d*)?\}|[*+?])|\.", re.S)


class Unreadable(ValueError):
    """A Java construct this module does not translate (never guessed)."""


@functools.cache
def _category_runs() -> tuple[tuple[int, int, str], ...]:
    """(first, last, category) for every run of code points sharing a general category."""
    runs: list[tuple[int, int, str]] = []
    start, current = 0, unicodedata.category("\0")
    for cp in range(1, sys.maxunicode + 2):
        cat = unicodedata.category(chr(cp)) if cp <= sys.maxunicode else None
        if cat != current:
            runs.append((start, cp - 1, current))
            start, current = cp, cat
    return tuple(runs)


def _class_body(name: str) -> str:
    """The inside of a character class holding what `\\p{name}` holds in Java."""
    if name in _POSIX:
        return "".join(re.escape(c) for c in _POSIX[name])
    if not re.fullmatch(r"[LMNPSZC][a-z]?", name):
        raise Unreadable(f"\\p{{{name}}}")
    runs = [(a, b) for a, b, cat in _category_runs() if cat.startswith(name)]
    if not runs:
        raise Unreadable(f"\\p{{{name}}}: no such Unicode category")
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in runs)


@functools.cache
def compiled(pattern: str) -> re.Pattern[str]:
    """The Python expression matching what the Java `pattern` matches."""
    in_class = False

    def token(m: re.Match[str]) -> str:
        nonlocal in_class
        text = m.group()
        if m.group(1):
            body = _class_body(m.group(2))
            if m.group(1) == "p":
                return body if in_class else f"[{body}]"
            if in_class:
                raise Unreadable(f"{text} inside a character class")
            return f"[^{body}]"
        if text.startswith("\\"):
            if len(text) > 2 or text[1] in "zZhQ":  # a surrogate (half a pair), or what Python reads otherwise
                raise Unreadable(text)
            return text
        if text == "[":
            if in_class:
                raise Unreadable("a nested character class (Java's union)")
            in_class = True
            return text
        if in_class or text == "]":  # inside a class, . and anchors are literals
            in_class = in_class and text != "]"
            return text
        return f"[^{_LINE_TERMINATORS}]" if text == "." else text[0]

    python = _TOKEN.sub(token, pattern)
    try:
        return re.compile(python, re.ASCII)
    except re.error as exc:
        raise Unreadable(f"{pattern!r}: {exc}") from None


def matches(pattern: str, value: str) -> bool:
    """Whether Java's `value.matches(pattern)` holds."""
    return compiled(pattern).fullmatch(value) is not None
