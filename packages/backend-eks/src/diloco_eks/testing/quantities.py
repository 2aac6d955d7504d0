"""Kubernetes resource quantities ("500m", "64Gi", "1e3", 8), parsed as the API server does.

The client's model types them as strings, but the server's Quantity also decodes JSON numbers,
and refuses at decode time (400) any text outside its grammar: a signed decimal number and one
suffix from the binary (Ki..Ei), decimal SI (n..E) or decimal-exponent (e3, E-2) families.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

QUANTITY_PATTERN = "^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"  # as the server's error message quotes it
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal(10**3),
            "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18)}


def parse_quantity(value: str | int | float) -> Decimal:
    """The quantity's value; ValueError (worded as the server's) when it is not one."""
    if isinstance(value, bool):
        raise ValueError(f"quantities must match the regular expression '{QUANTITY_PATTERN}'")
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    m = _QUANTITY.match(value)
    if not m:
        raise ValueError(f"quantities must match the regular expression '{QUANTITY_PATTERN}'")
    try:
        number = Decimal(m[1])
    except InvalidOperation:
        raise ValueError(f"quantities must match the regular expression '{QUANTITY_PATTERN}'") from None
    suffix = m[2] or ""
    if suffix in _BINARY:
        return number * _BINARY[suffix]
    if suffix in _DECIMAL:
        return number * _DECIMAL[suffix]
    return number * (Decimal(10) ** int(suffix[1:])) if suffix else number
