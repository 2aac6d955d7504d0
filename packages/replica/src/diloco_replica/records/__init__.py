"""What a replica records: its rows per round, the round's summary, the end-of-run report and plots."""
