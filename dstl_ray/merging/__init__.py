"""FLIP-306 file merging: the file pool of materialized state and the node's merged
changelog files."""
