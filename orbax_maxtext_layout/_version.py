from pathlib import Path

__version__ = "0.1.0"

EXAMPLES_DIR = Path(__file__).parent / "examples"
"""Shipped example: a real Tunix RL run and MaxText's checkpoint of the same model."""
