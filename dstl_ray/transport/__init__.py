"""How a writer's requests reach storage: through the node actors (Ray) or directly."""
