"""Scripts run by peer systems' own interpreters (never imported by the project)."""
