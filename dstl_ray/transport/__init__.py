"""How a writer's requests reach storage: what travels (requests, their sender), finding node
actors, lanes, and the transports (through the node actors by Ray, or directly)."""
