"""Fidelity: measured runs, the programs that predict them, and profiles fitted to them."""
