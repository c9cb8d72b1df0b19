"""What ``python -m fsdp1.run`` puts on the PYTHONPATH of the processes its script starts: this folder's
``sitecustomize`` (see there)."""
