"""halfmoon."""
