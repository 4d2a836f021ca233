"""Writing one file to DFS: attempts with deadlines, retries and hedging; freeing uploads no
log used."""
