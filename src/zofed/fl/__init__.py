"""Federated rounds: the wire protocol between clients and the server (see `zofed.fl.protocol`)."""
