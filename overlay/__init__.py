"""Sandboxes: OverlayFS stacks of layers, lifecycle, runtime shim, scheduler."""
