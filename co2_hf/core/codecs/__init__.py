"""The coded wires of the outer all-reduce."""
