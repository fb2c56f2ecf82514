"""Model management: the registry of what this replica holds, admin load/unload, on-demand loads, model
directories, and the replica watching its engines (healing, leak recycling)."""
