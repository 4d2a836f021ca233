"""The DFS behind the changelog: one contract, one module per backend, a registry from URL
to storage, and background deletes."""
