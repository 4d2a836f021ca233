"""File formats: changelog files and materialized state files."""
