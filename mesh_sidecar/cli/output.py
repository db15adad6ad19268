"""Where the command line writes: stdout for what people and scripts read (tables, tickets, JSON),
stderr for messages about the work (progress, errors)."""

from __future__ import annotations

from rich.console import Console

console = Console()
err_console = Console(stderr=True)
