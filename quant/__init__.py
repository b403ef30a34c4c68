"""quantserve: quant."""
