"""The GPU's single owner: registry, scheduler, Docker runtime, forwarding."""
