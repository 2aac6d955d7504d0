"""Watching a run from any shell: liveness, following, status and timeline display, export."""
