"""Plugins: finding backends and metric sinks through the `diloco` entry-point group, and the sinks."""
