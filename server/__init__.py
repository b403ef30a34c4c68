"""quantserve: server."""
