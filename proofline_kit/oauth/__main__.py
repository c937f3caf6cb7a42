"""``python -m proofline_kit.oauth``: run the test authorization server."""

from proofline_kit.oauth.authorization import main

main()
