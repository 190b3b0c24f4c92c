"""Runs of a spec: running one, comparing several, and the run folders they write and read."""
