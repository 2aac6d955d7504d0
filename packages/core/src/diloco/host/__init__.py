"""This machine's side of a run: the state directory and how anything is written in it, and whether a
recorded process is still the one that was recorded."""
