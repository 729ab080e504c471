"""Task adapters: the pre- and post-processing around a backend's forward pass, one module per task."""
