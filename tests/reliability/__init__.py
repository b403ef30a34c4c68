"""Fuzzing, hostile input, security, faults and the soak: what must never break."""
