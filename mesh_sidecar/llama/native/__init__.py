"""The C helper the weight cache compiles once: FNV-1a hashing and copying of tensor bytes."""
