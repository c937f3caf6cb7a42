"""Fault injection for tests and chaos soaks: a loopback TCP proxy with switchable network faults."""

from proofline_kit.faults.proxy import DIRECTIONS, MODES, FaultProxy, Mode, make_mode, read_mode, write_mode

__all__ = ["DIRECTIONS", "MODES", "FaultProxy", "Mode", "make_mode", "read_mode", "write_mode"]
