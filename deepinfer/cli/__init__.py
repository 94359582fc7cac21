"""Command line: `deepinfer serve | generate | bench | profile`."""
