"""pynorm: framework-free normalization layers with hand-written forward and backward."""
