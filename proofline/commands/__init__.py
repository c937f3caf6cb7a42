"""CLI commands that live in their own module; each is registered with one line in ``proofline/cli.py``."""
