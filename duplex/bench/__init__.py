"""`duplex bench`: paced synthetic sessions against the engine, batched vs per-session."""
