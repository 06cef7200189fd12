"""Sources of the libraries the symbolization tests compile, and the helper that builds them."""
