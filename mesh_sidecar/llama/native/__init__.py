"""The C helper the weight cache compiles once: copies tensor bytes, hashing them (FNV-1a, SHA-256) on the way."""
