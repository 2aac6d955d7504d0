"""Why a round could not go on, as the exceptions every part of a round raises and the training
loop answers (`RoundFailed`: fail the replica after its retries; `FellBehind`: rejoin from the
store). Their own module, so that the parts that raise them need not import each other."""

from __future__ import annotations


class RoundFailed(Exception):
    """A round could not complete (too few replicas, or an object never appeared)."""


class FellBehind(RoundFailed):
    """This replica's round is older than the history the store still keeps: rejoin instead."""
