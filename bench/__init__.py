"""quantserve: bench."""
