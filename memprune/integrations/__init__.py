"""memprune inside the memory layers people use: `mem0` (`PrunedMemory`, a Mem0 `Memory` kept within its rule)."""
