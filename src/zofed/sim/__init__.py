"""In-process simulation backend."""
