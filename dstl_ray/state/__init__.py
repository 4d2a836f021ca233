"""Keyed state over the changelog: descriptors and records, the keyed backend, its
materialization, its snapshots and the shared state registry that counts their files."""
