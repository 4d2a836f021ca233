"""Keyed state over the changelog: descriptors and records, the keyed backend, its
materialization."""
