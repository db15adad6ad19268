"""One running node: its lifecycle and its local control endpoint."""
