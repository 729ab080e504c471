"""The fleetbox TUI: watch and steer a fleet from a terminal, through NATS alone (docs/tui.md)."""
