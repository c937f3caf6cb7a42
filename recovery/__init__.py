"""What happens after a call: verification against the system of record, and recovery."""
