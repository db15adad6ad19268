"""The native data plane: ``mesh-data-relay`` (native/, its C sources), its build (build.py), the process
the sidecar runs and talks to (process.py), and the control lines between them (control_lines.py, pure)."""
