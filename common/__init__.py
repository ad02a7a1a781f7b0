"""Helpers shared by the proxy and the swapper (each image copies this package)."""
