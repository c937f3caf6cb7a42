"""Proofline: prove what an agent action changed before calling it done."""
