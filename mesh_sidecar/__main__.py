"""``python -m mesh_sidecar``: the same as the ``mesh-inference`` command."""

from .cli.main import main

main()
