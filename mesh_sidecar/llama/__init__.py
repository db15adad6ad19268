"""llama.cpp on this machine: the pinned build, its processes, model files, weight cache and memory sums."""
