"""quantserve: training."""
