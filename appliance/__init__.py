"""The fleetbox process: settings, CLI, NATS wiring, gateway, worker, batcher, catalog, residency."""

__version__ = "0.1.0"
