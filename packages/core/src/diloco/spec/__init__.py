"""The run spec: the TOML file, its tables, replica groups, the `[diloco]`/`[restart]` settings, and
what it will cost."""
