"""The `pattern` constraints of an AWS service model, read the way the service reads them.

AWS services are Java: a model's pattern is a `java.util.regex` expression, applied to the
whole value (`String.matches`). Python's `re` reads most of them alike; what it does not read is
translated here, each construct the same way Java defines it:

- `\\p{L}`, `\\p{N}`, `\\p{Lu}`… (Unicode general categories) → the code point ranges of that
  category, from `unicodedata` (Python's Unicode version, which may be a release or two apart
  from the service's JDK: only code points assigned in between can differ);
- `\\p{Alnum}`, `\\p{Alpha}`, `\\p{Digit}`, `\\p{Punct}`… (POSIX classes) → their US-ASCII sets,
  as Java defines them without UNICODE_CHARACTER_CLASS;
- `\\uD800\\uDC00` (a UTF-16 surrogate pair, how Java writes a code point above U+FFFF) → that
  code point;
- a quantified anchor (`${1,128}`, which Java accepts and Python does not) → the anchor;
- `\\z` → `\\Z`, `\\Z` → `(?=\\n?\\Z)`, `\\h` → Java's horizontal white space, `\\Q…\\E` → escaped text.

A pattern that still does not compile raises `UnsupportedPattern`: the validator reports it as
not checked rather than guessing (`tests/test_servicemodel.py` lists every pattern of the
SageMaker model and checks that each translates).
"""

from __future__ import annotations

import functools
import re
import sys
import unicodedata

POSIX = {
    "Lower": "a-z", "Upper": "A-Z", "ASCII": "\\x00-\\x7f", "Alpha": "a-zA-Z", "Digit": "0-9",
    "Alnum": "a-zA-Z0-9", "Punct": re.escape("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"),
    "Graph": "!-~", "Print": " -~", "Blank": " \\t", "Cntrl": "\\x00-\\x1f\\x7f", "XDigit": "0-9a-fA-F",
    "Space": " \\t\\n\\x0b\\f\\r",
}
HORIZONTAL_SPACE = " \\t\\xa0\\u1680\\u180e\\u2000-\\u200a\\u202f\\u205f\\u3000"
_SURROGATE_PAIR = re.compile(r"\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})", re.I)


class UnsupportedPattern(ValueError):
    """A Java pattern this module cannot read as Java does."""


def category_ranges(category: str) -> str:
    """The code points of a Unicode general category ("L", "Lu", "N"…) as a character-class body."""
    found = _categories().get(category)
    if found is None:
        raise UnsupportedPattern(f"unknown Unicode category \\p{{{category}}}")
    return found


@functools.cache
def _categories() -> dict[str, str]:
    """Every general category (two letters) and major class (one letter) as ranges, in one pass."""
    spans: dict[str, list[list[int]]] = {}
    for cp in range(sys.maxunicode + 1):
        cat = unicodedata.category(chr(cp))
        for key in (cat, cat[0]):
            runs = spans.setdefault(key, [])
            if runs and runs[-1][1] == cp - 1:
                runs[-1][1] = cp
            else:
                runs.append([cp, cp])
    return {key: "".join(_range(a, b) for a, b in runs) for key, runs in spans.items()}


def _range(a: int, b: int) -> str:
    return _char(a) if a == b else f"{_char(a)}-{_char(b)}"


def _char(cp: int) -> str:
    return f"\\U{cp:08x}"


def _class_body(name: str) -> str:
    if name in POSIX:
        return POSIX[name]
    name = name.removeprefix("Is").removeprefix("general_category=")
    if re.fullmatch(r"[LMNPSZC][a-z]?", name):
        return category_ranges(name)
    raise UnsupportedPattern(f"\\p{{{name}}} is not translated")


def translate(pattern: str) -> str:
    """A Python `re` pattern matching what the Java `pattern` matches."""
    text = _SURROGATE_PAIR.sub(lambda m: _char(0x10000 + ((int(m[1], 16) - 0xD800) << 10) + int(m[2], 16) - 0xDC00),
                               pattern)
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt in "pP" and i + 2 < len(text) and text[i + 2] == "{":
                end = text.index("}", i)
                body = _class_body(text[i + 3:end])
                if nxt == "P":
                    if in_class:
                        raise UnsupportedPattern("a negated \\P{…} inside a character class is not translated")
                    out.append(f"[^{body}]")
                else:
                    out.append(body if in_class else f"[{body}]")
                i = end + 1
                continue
            if nxt == "Q":
                end = text.find("\\E", i + 2)
                end = len(text) if end < 0 else end
                out.append(re.escape(text[i + 2:end]))
                i = end + 2
                continue
            if not in_class and nxt == "z":
                out.append("\\Z")
            elif not in_class and nxt == "Z":
                out.append("(?=\\n?\\Z)")
            elif nxt == "h":
                out.append(HORIZONTAL_SPACE if in_class else f"[{HORIZONTAL_SPACE}]")
            else:
                out.append(text[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            out.append(c)
            # a "]" or "^]" right after "[" is a literal in both dialects
            if text[i + 1:i + 2] == "^":
                out.append("^")
                i += 1
            if text[i + 1:i + 2] == "]":
                out.append("\\]")
                i += 1
            i += 1
            continue
        if c in "$^":
            quantifier = re.match(r"\{\d+(,\d*)?\}|[*+?]", text[i + 1:])
            out.append(c)
            i += 1 + (quantifier.end() if quantifier else 0)  # Java repeats an anchor; it still matches once
            continue
        out.append(c)
        i += 1
    translated = "".join(out)
    try:
        re.compile(translated)
    except re.error as exc:
        raise UnsupportedPattern(f"{pattern!r}: {exc}") from None
    return translated


@functools.cache
def compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(translate(pattern))


def full_match(pattern: str, value: str) -> bool:
    """Whether Java's `value.matches(pattern)` holds."""
    return compiled(pattern).fullmatch(value) is not None
