"""Device copies: the canonical bytes of a block, pinned host buffers, CUDA streams, gather and scatter. Imports
nothing of the other wings."""
