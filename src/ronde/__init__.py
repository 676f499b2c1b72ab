"""ronde: distributed data-parallel training (placeholder facade, being written)."""
__version__ = "0.1.0"
