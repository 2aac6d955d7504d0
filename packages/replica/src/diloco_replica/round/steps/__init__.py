"""The steps of a round, each returning what it found to the round's driver: upload, membership,
quorum, roster, reduce, gather, repairs, kept parts, error feedback."""
