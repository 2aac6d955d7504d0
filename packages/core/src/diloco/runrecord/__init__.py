"""A run's record on the launcher's disk: run.json and its ranks, events, artifacts, and the rounds
watched from the store."""
