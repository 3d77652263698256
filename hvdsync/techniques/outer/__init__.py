"""The outer synchronization of ``delay=`` (DiLoCo, Streaming DiLoCo; docs/delay.md)."""
