"""Model files, forward pass, attention backends and sampling."""
