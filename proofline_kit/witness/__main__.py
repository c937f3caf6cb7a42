"""``python -m proofline_kit.witness``: run a witness relay (see ``--help``)."""

from proofline_kit.witness.cli import main

main()
