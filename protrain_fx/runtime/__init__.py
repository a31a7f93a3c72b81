"""Runtime stage: what the rewritten graphs call at run time (chunks, swaps, CPU optimizer)."""
