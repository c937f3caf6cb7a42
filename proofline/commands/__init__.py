"""The ``proofline`` command line, one module per group of commands; ``proofline/cli.py`` wires
them into one group. ``base.py`` holds what every command shares (output, connections, errors)."""
