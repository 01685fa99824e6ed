"""The dsecfs command-line interface (click)."""
