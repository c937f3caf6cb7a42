"""CLI commands kept in their own modules, each registered with one line at the end of ``proofline/cli.py``."""
